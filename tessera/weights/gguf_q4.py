"""GGUF matrices stored as Q4_0, Q4_1 or Q4_K, kept as stored under `--quantization int4`.

All three quantize each row in groups of 32 weights with 4-bit codes, as tessera's int4
format does (tessera/ops/linear_int4.py: w = d * q + m, a float16 step d and offset m per 32
weights):
- Q4_1 block (32 weights, 20 bytes): d, m (float16), then 16 bytes of codes: byte j holds
  weight j in its low nibble and weight j + 16 in its high one; w = d * q + m. It is
  tessera's format itself.
- Q4_0 block (32 weights, 18 bytes): d, then the codes as Q4_1's; w = d * (q - 8), which is
  the int4 format with m = -8 d (exact in float16: a power-of-two multiple).
- Q4_K block (256 weights, 144 bytes): d, dmin (float16), 12 bytes packing eight 6-bit
  scales and eight 6-bit mins, then 128 bytes of codes (each 32 bytes: one group's codes in
  the low nibbles, the next group's in the high ones); w = d sc q - dmin mn per group. The
  group's step d sc and offset -dmin mn round to float16 here (a relative 2^-11 at most where
  they are normal float16s), far finer than quantizing the dequantized values again.

So an int4 model loaded from such a file runs on the file's weights (Q4_0 / Q4_1: exactly),
not a second rounding of them (dequantized to the model dtype, then quantized again). Read
as floats (`load`, `narrow`), every format gives the `gguf` package's values bit for bit.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tessera.ops.linear_int4 import GROUP, Int4Parts
from tessera.weights.lazy import LazyTensor

Q4_0, Q4_1, Q4_K = 2, 3, 12  # gguf.GGMLQuantizationType values
# (codes [n, k], step float32 [n, k / 32], offset float32) of blocks [n, blocks, block bytes]
Decoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 [n, blocks]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 16 j bytes] -> [..., 32 j] codes: each 16 bytes' low nibbles, then their high ones."""
    split = codes.unflatten(-1, (-1, 16))
    return torch.cat([split & 15, split >> 4], dim=-1).flatten(-2)


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(blocks, 0)
    return _nibbles(blocks[..., 2:]).flatten(1), d, d * -8


def _q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _nibbles(blocks[..., 4:]).flatten(1), _f16(blocks, 0), _f16(blocks, 2)


def _q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = blocks.shape[0]
    packed = blocks[..., 4:16].unflatten(-1, (3, 4)).int()
    low, high, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    scales = torch.cat([low & 63, (rest & 15) | ((low >> 2) & 48)], dim=-1)   # [n, blocks, 8]
    mins = torch.cat([high & 63, (rest >> 4) | ((high >> 2) & 48)], dim=-1)
    qs = blocks[..., 16:].unflatten(-1, (4, 32))                                # 4 x 32 bytes: 2 groups each
    codes = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(n, -1)
    step = (_f16(blocks, 0).unsqueeze(-1) * scales.float()).reshape(n, -1)
    offset = -(_f16(blocks, 2).unsqueeze(-1) * mins.float()).reshape(n, -1)
    return codes, step, offset


# type -> (weights a block, bytes a block, decoder)
_FORMATS: dict[int, tuple[int, int, Decoder]] = {Q4_0: (32, 18, _q4_0), Q4_1: (32, 20, _q4_1), Q4_K: (256, 144, _q4_k)}


def is_q4(tensor_type: int) -> bool:
    return tensor_type in _FORMATS


def _decoded(tensor_type: int, rows: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [n, k], step, offset float32 [n, k / 32]) of `rows` [n, bytes a row]."""
    weights, width, decode = _FORMATS[tensor_type]
    blocks = torch.from_numpy(np.array(rows, dtype=np.uint8))  # (a copy: the map is read-only)
    return decode(blocks.view(rows.shape[0], k // weights, width))


class Q4Rows(LazyTensor):
    """A Q4_0 / Q4_1 matrix of the file, dequantized to float32 when read (as any GGUF
    tensor), whose int4 parts a linear layer can take as stored (`int4_parts`)."""

    def __init__(self, name: str, tensor_type: int, data: np.ndarray, shape: tuple[int, int], lazy: bool):
        """`data`: the stored bytes, one row of blocks per output feature (a memory map, or
        rows reordered by the loader). `lazy`: too large to dequantize whole (see plain)."""
        self.name, self.tensor_type, self.data, self.shape = name, tensor_type, data, torch.Size(shape)
        self.lazy = lazy

    def plain(self) -> torch.Tensor | LazyTensor:
        """What a loader that takes no int4 parts gets (weights/loader.py): the float32
        tensor, or this, read by rows as narrowed, where the whole would be too large."""
        return self if self.lazy else self.load()

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def int4_parts(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> Int4Parts | None:
        """The stored (codes, d, m) of rows [start, start + length) and cols likewise (all by
        default); None where the columns split a block, or a step or offset overflows float16."""
        r0, nr = rows or (0, self.shape[0])
        c0, nc = cols or (0, self.shape[1])
        weights, width, _ = _FORMATS[self.tensor_type]
        if c0 % weights or nc % weights:
            return None
        data = self.data[r0:r0 + nr, c0 // weights * width:(c0 + nc) // weights * width]
        codes, step, offset = _decoded(self.tensor_type, data, nc)
        d, m = step.half(), offset.half()
        return (codes, d, m) if bool(torch.isfinite(d).all() and torch.isfinite(m).all()) else None

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.load().narrow(dim, start, length)
        codes, step, offset = _decoded(self.tensor_type, self.data[start:start + length], self.shape[1])
        n, k = codes.shape  # (as the gguf package computes: step * q, then the offset added)
        w = codes.view(n, k // GROUP, GROUP).float() * step.unsqueeze(2) + offset.unsqueeze(2)
        return w.reshape(n, k)

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])
