"""Int8 weight-only linear layers (`--quantization int8`): the reference builder.

Each output feature's weights are scaled symmetrically into [-127, 127] after loading
(scale = max |w| / 127 per row; the checkpoint stays as it is on disk) and the activations
stay in the model dtype. Weights take half the memory of bf16 and, where a kernel reads
them as int8 (tessera/ops/cpu/linear_int8.py), half the bandwidth. Per-channel int8 keeps
the result close to the unquantized model (tests/ops/test_linear_int8.py bounds it on a
real checkpoint); it is opt-in because it is not exact.

This builder runs anywhere: its prepared weight is one int8 tensor [n, k + 4] whose last four
bytes per row hold the row's float32 scale, widened to the activation dtype per call.

The CPU kernel (tessera/ops/cpu/linear_int8.py) scales in groups of GROUP = 32 input features
instead, as GGUF's Q8_0 does (`quantize_int8_groups`: a float16 step per group, relative to a
power of two per row; half a bit a weight more): a row's outliers then coarsen only their own
group, and a Q8_0 file's matrices, loaded in bf16, quantize back to the file's codes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.registry import register_op


CHUNK_ROWS = 4096  # rows quantized at a time: bounds the float32 temporaries (an LM head's
# would be several times its bf16 size at once)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (q int8 [n, k], scale float32 [n]) with weight ~= q * scale[:, None]."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[:1], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        w = weight[start:start + CHUNK_ROWS].float()
        s = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q[start:start + CHUNK_ROWS] = torch.round(w / s.unsqueeze(1)).clamp_(-127, 127)
        scale[start:start + CHUNK_ROWS] = s
    return q, scale


GROUP = 32
Int8Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # quantize_int8_groups' (q, d, scale)


def int8_groupable(weight: torch.Tensor) -> bool:
    """Whether `weight` [n, k] takes the grouped format: k a multiple of GROUP, every value
    finite."""
    if not (weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.shape[1] > 0
            and weight.is_floating_point()):
        return False
    if not weight.numel():
        return True
    low, high = torch.aminmax(weight)  # (no |w| copy of a whole LM head; NaN propagates)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def quantize_int8_groups(weight: torch.Tensor) -> Int8Groups:
    """weight [n, k] -> (q int8 [n, k], d float16 [n, k / GROUP], scale float32 [n]) with
    weight ~= q * d * scale per group of GROUP features: the group's step is its max |w| / 127,
    stored as a float16 d relative to its row's power of two `scale` (the largest step of the
    row over 2^frexp: d in (0, 1)), so steps keep float16's precision however small the
    weights (a plain float16 step turns subnormal below max |w| ~0.008 and zero below ~4e-6).
    d is rounded before the codes are chosen, so each code is the nearest for the stored step.
    A Q8_0 matrix's steps are float16s, which a power of two keeps exact: read in bf16 it gives
    back its codes (bar the few bf16's rounding moved) and its steps to bf16's precision."""
    if weight.device.type == "cpu":  # the same bits in one C pass (ops/cpu/quantize_groups.c)
        from tessera.ops.cpu.quantize_groups import quantize_int8_cpu
        parts = quantize_int8_cpu(weight)
        if parts is not None:
            return parts
    return _quantize_groups(weight)


def _quantize_groups(weight: torch.Tensor) -> Int8Groups:
    n, k = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    d = torch.empty((n, k // GROUP), dtype=torch.float16, device=weight.device)
    scale = torch.empty((n,), dtype=torch.float32, device=weight.device)
    for start in range(0, n, CHUNK_ROWS):
        w = weight[start:start + CHUNK_ROWS].float().reshape(-1, k // GROUP, GROUP)
        step = w.abs().amax(dim=2) / 127.0
        _, exponent = torch.frexp(step.amax(dim=1))              # (0 for a zero row)
        row = torch.ldexp(torch.ones_like(step[:, 0]), exponent)  # a power of two: exact products
        stored = (step / row.unsqueeze(1)).half()
        effective = stored.float() * row.unsqueeze(1)
        safe = torch.where(effective > 0, effective, torch.ones_like(effective))
        q[start:start + CHUNK_ROWS] = torch.round(w / safe.unsqueeze(2)).clamp_(-127, 127).reshape(-1, k)
        d[start:start + CHUNK_ROWS] = stored
        scale[start:start + CHUNK_ROWS] = row
    return q, d, scale


def dequantize_int8_groups(q: torch.Tensor, d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [n, k] from quantize_int8_groups' parts."""
    n, k = q.shape
    step = d.float() * scale.float().unsqueeze(1)
    return (q.float().reshape(n, k // GROUP, GROUP) * step.unsqueeze(2)).reshape(n, k)


def quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> int8 [n, k + 4]: each row's values, then its float32 scale's bytes."""
    if weight.dtype == torch.int8:
        return weight  # prepared already
    q, scale = quantize_int8(weight)
    return torch.cat([q, scale.unsqueeze(1).view(torch.int8)], dim=1)


def split_rows(prepared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q [n, k], scale [n]) of a quantize_rows tensor."""
    return prepared[:, :-4], prepared[:, -4:].contiguous().view(torch.float32).squeeze(1)


def linear_int8_rows(x: torch.Tensor, prepared: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    q, scale = split_rows(prepared)
    if q.shape[1] != x.shape[-1]:
        raise ValueError(f"input has {x.shape[-1]} features, the int8 weight expects {q.shape[1]}")
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


@register_op("linear", name="torch_linear_int8", priority=0, quant=("int8",), prepare=quantize_rows)
def linear_int8_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear_int8_rows(x, weight, bias)
