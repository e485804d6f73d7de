"""Dense weights from the tensors of pre-quantized checkpoints: integers packed into int32
words, fp8 or int8 values, and the scales (per tensor, output channel, group of input
columns, or 2-D block) and zero points that bring them back to real numbers.

Everything here works on one linear weight in Hugging Face orientation, [out, in], in
float32; the formats' own layouts (GPTQ's transposed words, AWQ's interleaved columns) are
turned into it by the callers in weights/prequantized.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs columns 0..7 of a word into these nibbles


@dataclass(frozen=True)
class ScaleLayout:
    """Which weights one scale (or zero point) covers."""

    strategy: str                    # "tensor", "channel", "group" or "block"
    group_size: int = 0              # group: consecutive input columns per scale
    block: tuple[int, int] = (0, 0)  # block: [rows, columns] per scale


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int, dim: int, exact: bool = False) -> torch.Tensor:
    """Unsigned `num_bits`-bit values packed along `dim` of int32 words, low bits first: the
    first `count` of them along `dim`. Dense packing puts value i at bit i * num_bits of the
    word stream (a value may straddle two words); older compressed-tensors releases padded
    instead, 32 // num_bits values to a word. The two differ only at 3, 5, 6 and 7 bits, and
    then (beyond a few dozen values) in the number of words, which tells them apart; where
    the counts agree, dense (today's layout) is read. With `exact`, any other number of
    words is an error (a wrong bit width would otherwise unpack silently)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    if not 1 <= num_bits <= 8:
        raise ValueError(f"cannot unpack {num_bits}-bit values (1 to 8 bits)")
    width, per_word = packed.shape[dim], 32 // num_bits
    dense, padded = -(-count * num_bits // 32), -(-count // per_word)
    if (width not in (dense, padded)) if exact else width < dense:
        raise ValueError(f"{width} int32 words along dim {dim} do not hold {count} {num_bits}-bit values "
                         f"(packed densely: {dense} words; padded: {padded})")
    words = packed.movedim(dim, -1)
    if num_bits in (4, 8) and sys.byteorder == "little":  # the words' bytes, low byte first
        low_first = words.contiguous().view(torch.uint8)
        if num_bits == 4:
            low_first = torch.stack((low_first & 0xF, low_first >> 4), dim=-1).flatten(-2)
        return low_first[..., :count].to(torch.int16).movedim(-1, dim)
    if 32 % num_bits == 0 or width == padded != dense:  # no value straddles a word: shift each in place
        shifts = torch.arange(0, per_word * num_bits, num_bits, dtype=torch.int32)
        values = (words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
        return values.flatten(-2)[..., :count].movedim(-1, dim)
    words = words.to(torch.int64) & 0xFFFFFFFF
    # each word with its successor above it, so a straddling value reads in one shift
    following = torch.cat([words[..., 1:], torch.zeros_like(words[..., :1])], dim=-1)
    windows = words | (following << 32)
    starts = torch.arange(count) * num_bits
    values = (windows[..., starts // 32] >> (starts % 32)) & ((1 << num_bits) - 1)
    return values.movedim(-1, dim)


def expand_scales(values: torch.Tensor, layout: ScaleLayout, rows: int, cols: int,
                  g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Per-weight values (broadcastable to [rows, cols]) from per-tensor, -channel, -group
    or -block ones; `g_idx` maps each input column to its group (GPTQ's activation order)."""
    values = values.to(torch.float32)
    if layout.strategy == "tensor":
        if values.numel() != 1:
            raise ValueError(f"a per-tensor scale has one value, got shape {tuple(values.shape)}")
        return values.reshape(1, 1)
    if layout.strategy == "channel":
        if values.numel() != rows:
            raise ValueError(f"per-channel scales: {tuple(values.shape)} for {rows} output rows")
        return values.reshape(rows, 1)
    if layout.strategy == "group":
        groups = values.reshape(rows, -1) if values.numel() % rows == 0 else None
        if g_idx is None and groups is not None and layout.group_size > 0 \
                and groups.shape[1] != -(-cols // layout.group_size):
            groups = None  # one scale per group, no more and no fewer
        if g_idx is not None:
            index = g_idx.to(torch.int64).reshape(-1)
            if index.numel() != cols:
                raise ValueError(f"g_idx has {index.numel()} entries for {cols} input columns")
        else:
            if layout.group_size <= 0:
                raise ValueError("group scales need a group size")
            index = torch.arange(cols) // layout.group_size
        if groups is None or int(index.max()) >= groups.shape[1] or int(index.min()) < 0:
            raise ValueError(f"group scales of shape {tuple(values.shape)} do not cover a "
                             f"[{rows}, {cols}] weight in groups of {layout.group_size}")
        return groups[:, index]
    if layout.strategy == "block":
        block_rows, block_cols = layout.block
        want = (-(-rows // block_rows), -(-cols // block_cols))
        if tuple(values.shape) != want:
            raise ValueError(f"block scales of shape {tuple(values.shape)} for a [{rows}, {cols}] "
                             f"weight in {block_rows}x{block_cols} blocks (want {want})")
        return (values.repeat_interleave(block_rows, 0)[:rows]
                .repeat_interleave(block_cols, 1)[:, :cols])
    raise ValueError(f"unknown scale strategy {layout.strategy!r}")


def dequantize_weight(quantized: torch.Tensor, scale: torch.Tensor, layout: ScaleLayout,
                      zero_point: torch.Tensor | None = None,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """(quantized - zero_point) * scale for an [out, in] weight, in float32."""
    if quantized.dim() != 2:
        raise ValueError(f"expected a 2-D [out, in] weight, got shape {tuple(quantized.shape)}")
    rows, cols = quantized.shape
    weight = quantized.to(torch.float32, copy=True)  # scaled in place: never the caller's tensor
    size = layout.group_size
    if g_idx is not None and size > 0 and g_idx.numel() == cols \
            and torch.equal(g_idx.to(torch.int64).reshape(-1), torch.arange(cols) // size):
        g_idx = None  # written without activation order too (GPTQ does): the plain groups
    if layout.strategy == "group" and g_idx is None and size > 0 and cols % size == 0 \
            and scale.numel() == rows * cols // size:  # the common case, without a gather
        grouped = weight.view(rows, cols // size, size)
        if zero_point is not None:
            grouped -= zero_point.reshape(rows, -1, 1).to(torch.float32)
        grouped *= scale.reshape(rows, -1, 1).to(torch.float32)
        return weight
    if zero_point is not None:
        weight -= expand_scales(zero_point, layout, rows, cols, g_idx)
    weight *= expand_scales(scale, layout, rows, cols, g_idx)
    return weight


def awq_unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """AWQ's 4-bit [rows, cols / 8] words, columns interleaved within a word, as [rows, cols]."""
    nibbles = unpack_int32(packed, 4, cols, dim=1)
    rows = nibbles.shape[0]
    return nibbles.reshape(rows, cols // 8, 8)[..., list(AWQ_COLUMN_NIBBLE)].reshape(rows, cols)
