"""Int4 weight-only linear layers (`--quantization int4`): the format and the reference builder.

Each output feature's weights are quantized in groups of GROUP = 32 input features,
asymmetrically, as GGUF's Q4_1 does: w ~= d * q + m with codes q in 0..15, the group's
step d = (max - min) / 15 and offset m = min, both stored as float16 (5 bits per weight in
all, a third of bf16's bytes). Single-stream decode streams every weight once per token,
so it reads that much less; the cost is accuracy (tests/ops/test_linear_int4.py bounds it on
the default model), hence opt-in.

Layers whose in-features are not a multiple of GROUP, or with a value beyond float16's range,
keep their float weights (every projection of the supported families is a multiple). The
LM head takes int8 instead (tessera/ops/embedding.py): the vocabulary projection is the
layer most sensitive to weight error, which is why llama.cpp's 4-bit files keep it at 6 or
8 bits (the default model's GGUF stores it as Q8_0).

This builder runs anywhere: its prepared weight is one uint8 tensor [n, 5 k / 8] per output
feature row: the k / 2 bytes of codes (input feature 2i in the low nibble of byte i, 2i + 1
in the high), then each group's d and m as float16 bytes. It dequantizes per call, so it is for
correctness and devices without a kernel, not speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.registry import register_op

GROUP = 32
FLOAT16_MAX = 65504.0
CHUNK_ROWS = 4096  # rows quantized at a time: bounds the float32 temporaries of a big matrix


def int4_quantizable(weight: torch.Tensor) -> bool:
    """Whether `weight` [n, k] takes the int4 format: k a multiple of GROUP, and every value
    finite and within float16's range (a group's offset is a float16)."""
    if not (weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.shape[1] > 0
            and weight.is_floating_point()):
        return False
    largest = weight.abs().amax().item() if weight.numel() else 0.0
    return largest < FLOAT16_MAX  # False for inf and NaN too


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (codes uint8 [n, k] in 0..15, d float16 [n, k / GROUP],
    m float16 [n, k / GROUP]) with weight ~= codes * d + m per group.

    m is the group's minimum rounded down to a float16 and d its range over 15 rounded to a
    float16, both before the codes are chosen, so each code is the nearest for the stored
    step and offset: the error is at most half a step (plus the step's rounding) where the
    step is a normal float16 (a group's range above ~1e-3); narrower groups lose precision
    to float16's subnormals, as GGUF's Q4_1 does."""
    if weight.device.type == "cpu":  # the same bits in one C pass (ops/cpu/quantize_groups.c)
        from tessera.ops.cpu.quantize_groups import quantize_int4_cpu
        parts = quantize_int4_cpu(weight)
        if parts is not None:
            return parts
    parts = [_quantize_rows(weight[i:i + CHUNK_ROWS]) for i in range(0, weight.shape[0], CHUNK_ROWS)]
    if not parts:
        return _quantize_rows(weight)
    return tuple(torch.cat(p) for p in zip(*parts))


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    w = weight.to(torch.float32, copy=True).reshape(n, k // GROUP, GROUP)  # (worked on in place)
    low, high = torch.aminmax(w, dim=2)
    m = low.to(torch.float16)
    # rounded down, so that the step (high - m) / 15 is never negative
    m = torch.where(m.float() > low, torch.nextafter(m, torch.full_like(m, float("-inf"))), m)
    d = ((high - m.float()) / 15).to(torch.float16)
    step = d.float().unsqueeze(2)
    # a group whose step rounds to 0 spans under 15 * 2^-25, so each w - m rounds to code 0
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = w.sub_(m.float().unsqueeze(2)).div_(safe).round_().clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), d, m


def dequantize_int4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 [n, k] from quantize_int4's parts."""
    n, k = codes.shape
    w = codes.float().reshape(n, k // GROUP, GROUP) * d.float().unsqueeze(2) + m.float().unsqueeze(2)
    return w.reshape(n, k)


Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # quantize_int4's (codes, d, m)


def int4_parts(weight: torch.Tensor, stored: Int4Parts | None) -> Int4Parts:
    """The int4 parts of `weight` [n, k]: `stored`, the parts its checkpoint stored where it
    did (a GGUF's Q4_0 / Q4_1 / Q4_K rows, StoredInt4), else weight quantized."""
    if stored is None:
        return quantize_int4(weight)
    if tuple(stored[0].shape) != tuple(weight.shape):
        raise ValueError(f"stored int4 codes {tuple(stored[0].shape)} != weight {tuple(weight.shape)}")
    return tuple(part.to(weight.device) for part in stored)  # (read from the file on the host)


class StoredInt4:
    """Where a linear layer's loaded weight rows came from, for checkpoint tensors that keep
    int4 parts as stored (`int4_parts(rows, cols)`: tessera/weights/gguf_q4.py), so the layer
    prepares those instead of quantizing its dequantized copy. A span loaded from any other
    tensor, or loaded twice, means the parts are not the weight's. It also hears of tensors
    the checkpoint stores wider than int4 in a file mostly 4-bit (`stored_wider`: a GGUF
    K-quant mix's Q6_K attn_v / ffn_down), for which the layer takes int8 instead."""

    def __init__(self, rows: int):
        self.rows = rows
        self.spans: list[tuple[int, int, object]] = []  # (first row, rows, a () -> parts or None)
        self.wider = False  # some rows came from a tensor stored wider than int4

    def note(self, start: int, tensor: object, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Rows [start, start + rows[1]) of the weight were copied from `tensor`'s rows and cols
        (each (first, length))."""
        get = getattr(tensor, "int4_parts", None)
        self.spans.append((start, rows[1], None if get is None else lambda: get(rows, cols)))
        self.wider |= bool(getattr(tensor, "stored_wider", False))

    def parts(self) -> Int4Parts | None:
        """The weight's stored parts, where every row came once from such a tensor."""
        spans = sorted(self.spans, key=lambda s: s[0])
        if not spans or any(get is None for _, _, get in spans) or sum(n for _, n, _ in spans) != self.rows:
            return None
        if any(a[0] + a[1] != b[0] for a, b in zip(spans, spans[1:])) or spans[0][0] != 0:
            return None
        parts = [get() for _, _, get in spans]
        if any(p is None for p in parts):
            return None
        return tuple(torch.cat(p) for p in zip(*parts))


def pack_int4_rows(weight: torch.Tensor, stored: Int4Parts | None = None) -> torch.Tensor:
    """[n, k] float -> uint8 [n, 5 k / 8] (the reference layout), or the weight itself when
    it is prepared already or does not take the format. `stored`: its parts as the checkpoint
    stored them (int4_parts)."""
    if weight.dtype == torch.uint8 or not int4_quantizable(weight):
        return weight
    codes, d, m = int4_parts(weight, stored)
    n, k = codes.shape
    nibbles = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.stack([d, m], dim=2).reshape(n, 2 * k // GROUP).view(torch.uint8)
    return torch.cat([nibbles, scales], dim=1).contiguous()


def unpack_int4_rows(prepared: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [n, k], d, m) of a pack_int4_rows tensor for `k` in-features."""
    if prepared.shape[1] != 5 * k // 8 or k % GROUP:
        raise ValueError(f"input has {k} features; the int4 weight {tuple(prepared.shape)} "
                         f"expects {prepared.shape[1] * 8 // 5}")
    n = prepared.shape[0]
    nibbles = prepared[:, :k // 2]
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=2).reshape(n, k)
    scales = prepared[:, k // 2:].contiguous().view(torch.float16).reshape(n, k // GROUP, 2)
    return codes, scales[..., 0], scales[..., 1]


def linear_int4_rows(x: torch.Tensor, prepared: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if prepared.dtype == torch.int8:  # a matrix the file keeps wider, in int8's layout (StoredInt4.wider)
        from tessera.ops.linear_int8 import linear_int8_rows
        return linear_int8_rows(x, prepared, bias)
    if prepared.dtype != torch.uint8:  # a layer that kept its float weights
        return F.linear(x, prepared.to(x.dtype), bias)
    weight = dequantize_int4(*unpack_int4_rows(prepared, x.shape[-1])).to(x.dtype)
    return F.linear(x, weight, bias)


@register_op("linear", name="torch_linear_int4", priority=0, quant=("int4",), prepare=pack_int4_rows)
def linear_int4_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear_int4_rows(x, weight, bias)


def lm_head_quantization(quant: str | None) -> str | None:
    """The LM head's weight format under `quant`: int8 where the layers take int4 (see the
    module docstring), else the same."""
    return "int8" if quant == "int4" else quant
