"""Int8 weight-only linear layers (`--quantization int8`): the reference builder.

Each output feature's weights are scaled symmetrically into [-127, 127] after loading
(scale = max |w| / 127 per row; the checkpoint stays as it is on disk) and the activations
stay in the model dtype. Weights take half the memory of bf16 and, where a kernel reads
them as int8 (tessera/ops/cpu/linear_int8.py), half the bandwidth. Per-channel int8 keeps
the result close to the unquantized model (tests/ops/test_linear_int8.py bounds it on a
real checkpoint); it is opt-in because it is not exact.

This builder runs anywhere: its prepared weight is one int8 tensor [n, k + 4] whose last four
bytes per row hold the row's float32 scale, widened to the activation dtype per call.
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
