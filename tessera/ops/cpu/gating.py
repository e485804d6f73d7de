"""The elementwise ops of hybrid models on CPU (gating.h, built as gating.c or, without
AVX512, gating_avx2.c): the Gated DeltaNet's decay and write strength (`delta_rule_gates`),
the gated output RMSNorm (`gated_rms_norm`: the Gated DeltaNet's norm first, Mamba-2's gate
first, Falcon-H1's per group), a sigmoid output gate (`sigmoid_gate_mul`), and Nemotron-H's
relu(x)^2 (`relu_squared`), and Granite's scaled residual sums (`sum_and_scale`). Each
replaces 1-12 torch ops a layer, so that Qwen3.5's, Qwen3-Next's, the Mamba-2 hybrids' and
Granite's decode steps are kernels alone, which the kernel graphs replay. Roundings are the torch builders' op by op; exp is a polynomial within 2e-7
of torch's, so a bf16 result can differ from torch's by one unit where the float32 value
sits on a rounding edge.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera.ops.activation import relu_squared_ref, sigmoid_gate_mul_ref, sum_and_scale_ref
from tessera.ops.cpu.build import Kernel
from tessera.ops.linear_attention.delta_rule import delta_rule_gates_ref
from tessera.ops.norm import gated_rms_norm_ref
from tessera.ops.registry import register_op

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_GATES = Kernel("gating.c", "tessera_delta_gates", (_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _I64, _INT),
                fallback_source="gating_avx2.c")
_NORM = Kernel("gating.c", "tessera_gated_rms_norm",
               (_P, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, ctypes.c_float, _INT, _INT, _INT),
               fallback_source="gating_avx2.c")
_SIGMOID = Kernel("gating.c", "tessera_sigmoid_gate_mul", (_P, _I64, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _INT, _INT),
                  fallback_source="gating_avx2.c")
_RELU_SQUARED = Kernel("gating.c", "tessera_relu_squared", (_P, _P, _I64, _INT, _INT), fallback_source="gating_avx2.c")
_SUM_AND_SCALE = Kernel("gating.c", "tessera_sum_and_scale",
                        (_P, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _I64, ctypes.c_float, _INT, _INT),
                        fallback_source="gating_avx2.c")
_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD = 1024  # the norm's group size: its per-group stack buffers (gating.h's GATE_CHUNK)


def _rows(x: torch.Tensor) -> bool:
    """2-D with its columns adjacent (rows may be any stride apart)."""
    return x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)


@register_op("delta_rule_gates", name="cpu_delta_rule_gates", priority=10, devices=("cpu",), dtypes=_DTYPES,
             check=_GATES.check)
def delta_rule_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_gates_ref's (g, beta), float32 [T, Hv]."""
    tokens, heads = a.shape[0], a.shape[-1]
    if not (a.dtype in _DTYPES and all(t.dtype == a.dtype for t in (b, a_log, dt_bias)) and _rows(a) and _rows(b)
            and b.shape == a.shape and a_log.shape == (heads,) and dt_bias.shape == (heads,)
            and a_log.is_contiguous() and dt_bias.is_contiguous()):
        return delta_rule_gates_ref(a, b, a_log, dt_bias)
    g = torch.empty((tokens, heads), dtype=torch.float32)
    beta = torch.empty((tokens, heads), dtype=torch.float32)
    if tokens and heads:
        _GATES(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), a_log.data_ptr(), dt_bias.data_ptr(),
               g.data_ptr(), beta.data_ptr(), tokens, heads, int(a.dtype == torch.bfloat16))
    return g, beta


@register_op("gated_rms_norm", name="cpu_gated_rms_norm", priority=10, devices=("cpu",), dtypes=_DTYPES,
             check=_NORM.check)
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   gate_first: bool = False, group_size: int | None = None) -> torch.Tensor:
    """gated_rms_norm_ref's op, its three forms: x contiguous ([T, H, D] from the delta rule,
    [T, inner] from a Mamba-2 scan), gate of x's shape with each token's values adjacent
    (a column slice of the packed projection), weight over x's last dimension."""
    width = x.shape[-1]
    group = group_size or width
    if not (x.dim() >= 2 and x.is_contiguous() and x.dtype in _DTYPES and gate.dtype == x.dtype
            and weight.dtype == x.dtype and gate.shape == x.shape and _token_rows(gate)
            and weight.shape == (width,) and weight.is_contiguous() and 0 < group <= MAX_HEAD and width % group == 0):
        return gated_rms_norm_ref(x, gate, weight, eps, gate_first, group_size)
    tokens = x.shape[0]
    groups = x[0].numel() // group if tokens else 0
    mode = 1 if gate_first else 0 if group_size is None else 2
    out = torch.empty(x.shape, dtype=x.dtype)
    if tokens and groups:
        _NORM(x.data_ptr(), gate.data_ptr(), gate.stride(0), weight.data_ptr(), width, out.data_ptr(), tokens, groups,
              group, eps, mode, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def _token_rows(x: torch.Tensor) -> bool:
    """Each token's (first index's) values adjacent, in order; tokens any stride apart."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@register_op("sigmoid_gate_mul", name="cpu_sigmoid_gate_mul", priority=10, devices=("cpu",), dtypes=_DTYPES,
             check=_SIGMOID.check)
def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """sigmoid_gate_mul_ref's op: x, gate, add as 2-D rows (any row stride)."""
    rows, cols = x.shape[0], x.shape[-1]
    if not (x.dtype in _DTYPES and gate.dtype == x.dtype and _rows(x) and _rows(gate) and gate.shape[0] == rows
            and gate.shape[1] in (1, cols) and (add is None or (add.dtype == x.dtype and _rows(add)
                                                                and add.shape == x.shape))):
        return sigmoid_gate_mul_ref(x, gate, add)
    out = torch.empty((rows, cols), dtype=x.dtype)
    if rows and cols:
        _SIGMOID(x.data_ptr(), x.stride(0), gate.data_ptr(), gate.stride(0), gate.shape[1],
                 0 if add is None else add.data_ptr(), 0 if add is None else add.stride(0), out.data_ptr(), rows,
                 cols, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


@register_op("relu_squared", name="cpu_relu_squared", priority=10, devices=("cpu",), dtypes=_DTYPES,
             check=_RELU_SQUARED.check)
def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu_squared_ref's op (Nemotron-H's MLP), bit-exact."""
    if x.dtype not in _DTYPES:
        return relu_squared_ref(x)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.numel():
        _RELU_SQUARED(x.data_ptr(), out.data_ptr(), x.numel(), int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def relu_squared_kernel() -> Kernel | None:
    """gating.h's relu squared (x, out, n, is_bf16, threads), where it runs here: the
    one-call MoE layer's ungated activation (ops/cpu/moe_experts.py)."""
    return None if _RELU_SQUARED.check(None) else _RELU_SQUARED


@register_op("sum_and_scale", name="cpu_sum_and_scale", priority=10, devices=("cpu",), dtypes=_DTYPES,
             check=_SUM_AND_SCALE.check)
def sum_and_scale(x: torch.Tensor, other: torch.Tensor | None = None,
                  scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """sum_and_scale_ref's op, bit-exact: x and other as 2-D rows (any row stride), a
    tensor scale of x's dtype, contiguous, one a row ([rows, 1]) or one a column ([cols])."""
    scales = scale if isinstance(scale, torch.Tensor) else None
    steps = None if scales is None else {(x.shape[0], 1): (1, 0), (x.shape[1],): (0, 1)}.get(tuple(scales.shape))
    if not (x.dtype in _DTYPES and _rows(x) and (other is None or (other.dtype == x.dtype and other.shape == x.shape
                                                                    and _rows(other)))
            and (scales is None or (scales.dtype == x.dtype and steps is not None and scales.is_contiguous()))):
        return sum_and_scale_ref(x, other, scale)
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.numel():
        row_step, col_step = steps or (0, 0)
        _SUM_AND_SCALE(x.data_ptr(), x.stride(0), 0 if other is None else other.data_ptr(),
                       0 if other is None else other.stride(0), 0 if scales is None else scales.data_ptr(),
                       row_step, col_step, out.data_ptr(), x.shape[0], x.shape[1], 1.0 if scales is not None else scale,
                       int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out
