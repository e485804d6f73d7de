"""Gated DeltaNet decode builders for CPU (gated_delta.h, built as gated_delta.c or, without
AVX512, gated_delta_avx2.c): the gated delta rule and the causal conv1d + SiLU before it;
and LFM2's gated short convolution (C * conv(B x), one kernel for the whole operator).

The torch delta rule gathers the slots' states, scales them, runs two einsums and scatters
back: several full-size temporaries of a state that is 1 MiB per sequence per layer
(Qwen3.5-0.8B's 16 heads of 128 x 128), 0.25 ms at batch 1 and 60 ms at batch 32 per layer
on a 2-core Zen 4. The kernel reads each head's state once, updates it in place from cache
and takes q, k, v where the conv left them: 30 us and 1.2-1.5 ms (an in-place pass over
32 MiB takes 0.9 ms there). Its float32 sums run in another order than torch's (outputs and
states agree to float32 rounding, not bit for bit). The conv kernel (9-17x torch's op) is
bit-exact before SiLU for K <= 4 (torch sums 5 and 6 taps in another order); its SiLU is
silu_and_mul's, bit-exact in bf16.

Both pass every size as a kernel argument and allocate only their outputs, so a decode step
made of kernels stays capturable (ops/cpu/graph.py).
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.linear_attention.conv import causal_conv1d_decode_ref, short_conv_decode_ref
from tessera.ops.linear_attention.delta_rule import gated_delta_decode_ref
from tessera.ops.registry import register_op

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_RULE = Kernel("gated_delta.c", "tessera_gated_delta_decode", (_P,) * 8 + (_I64,) * 9 + (_INT, _INT),
               ctypes.c_int, fallback_source="gated_delta_avx2.c")
_CONV = Kernel("gated_delta.c", "tessera_causal_conv1d_decode",
               (_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT), fallback_source="gated_delta_avx2.c")
_SHORT_CONV = Kernel("gated_delta.c", "tessera_gated_short_conv_decode", _CONV.argtypes,
                     fallback_source="gated_delta_avx2.c")
_DTYPES = (torch.float32, torch.bfloat16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, D] with its heads side by side in each row (rows may have any stride)."""
    _, s1, s2 = x.stride()
    return x if s2 == 1 and s1 == x.shape[2] else x.contiguous()


@register_op("gated_delta_rule", name="cpu_gated_delta_decode", priority=10, devices=("cpu",),
             dtypes=_DTYPES, phases=("decode",), check=_RULE.check)
def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """gated_delta_decode_ref's op: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] float32,
    state [slots, Hv, Dk, Dv] float32 (updated in place at `slots` [B]) -> [B, Hv, Dv]."""
    b, hk, dk = q.shape
    _, hv, dv = v.shape
    dtype, f32 = v.dtype, torch.float32
    if (dtype not in _DTYPES or q.dtype is not dtype or k.dtype is not dtype or g.dtype is not f32
            or beta.dtype is not f32 or state.dtype is not f32 or slots.dtype is not torch.int64
            or k.shape != q.shape or state.shape[1:] != (hv, dk, dv) or not state.is_contiguous()):
        return gated_delta_decode_ref(q, k, v, g, beta, state, slots)
    q, k, v = _rows(q), _rows(k), _rows(v)
    g, beta, slots = g.contiguous(), beta.contiguous(), slots.contiguous()
    out = torch.empty((b, hv, dv), dtype=dtype)
    # nonzero: a shape the kernel does not take (hv % hk, head sizes past its buffers), before
    # it touched anything
    if b and _RULE(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(),
                   slots.data_ptr(), out.data_ptr(), b, hk, hv, dk, dv, q.stride(0), k.stride(0), v.stride(0),
                   hv, dtype is torch.bfloat16, torch.get_num_threads()):
        return gated_delta_decode_ref(q, k, v, g, beta, state, slots)
    return out


@register_op("causal_conv1d", name="cpu_causal_conv1d_decode", priority=10, devices=("cpu",),
             dtypes=_DTYPES, phases=("decode",), check=_CONV.check)
def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """causal_conv1d_decode_ref's op: x [B, C], weight [C, K], conv_state [slots, C, K - 1]
    (updated in place at `slots` [B]) -> [B, C]."""
    if not _conv_takes(x, 1, weight, bias, conv_state, slots):
        return causal_conv1d_decode_ref(x, weight, bias, conv_state, slots)
    return _conv(_CONV, x, weight, bias, conv_state, slots)


@register_op("short_conv", name="cpu_gated_short_conv_decode", priority=10, devices=("cpu",),
             dtypes=_DTYPES, phases=("decode",), check=_SHORT_CONV.check)
def gated_short_conv_decode(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """short_conv_decode_ref's op (LFM2): bcx [B, 3C] packing B, C and x -> C * conv(B x),
    [B, C], with the reference's roundings."""
    if not _conv_takes(bcx, 3, weight, bias, conv_state, slots):
        return short_conv_decode_ref(bcx, weight, bias, conv_state, slots)
    return _conv(_SHORT_CONV, bcx, weight, bias, conv_state, slots)


def _conv_takes(x: torch.Tensor, parts: int, weight: torch.Tensor, bias: torch.Tensor | None,
                conv_state: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether the conv kernels take these: rows of `parts` x C channels, one dtype."""
    return (x.dtype in _DTYPES and x.dim() == 2 and weight.dtype == x.dtype and conv_state.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and weight.dim() == 2 and weight.shape[1] >= 1
            and x.shape[1] == parts * weight.shape[0] and conv_state.shape[1:] == (weight.shape[0], weight.shape[1] - 1)
            and conv_state.is_contiguous() and slots.dtype == torch.int64)


def _conv(kernel: Kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, slots = weight.contiguous(), slots.contiguous()
    bias = None if bias is None else bias.contiguous()
    b, c = x.shape[0], weight.shape[0]
    out = torch.empty((b, c), dtype=x.dtype)
    if b and c:
        kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
               conv_state.data_ptr(), slots.data_ptr(), out.data_ptr(), b, c, weight.shape[1],
               int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out
