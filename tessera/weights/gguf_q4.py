"""GGUF matrices stored as Q4_0 or Q4_1, kept as stored under `--quantization int4`.

Both formats quantize each row in blocks of 32 weights, as tessera's int4 format does
(tessera/ops/linear_int4.py: w = d * q + m, a float16 step d and offset m per 32 weights):
- Q4_1 block (20 bytes): d, m (float16), then 16 bytes of codes: byte j holds weight j in its
  low nibble and weight j + 16 in its high one; w = d * q + m. It is tessera's format itself.
- Q4_0 block (18 bytes): d, then the codes as Q4_1's; w = d * (q - 8), which is the int4
  format with m = -8 d (exact in float16: a power-of-two multiple).

So an int4 model loaded from such a file runs on exactly the file's weights, not a second
rounding of them (dequantized to the model dtype, then quantized again).
"""
from __future__ import annotations

import numpy as np
import torch

from tessera.ops.linear_int4 import Int4Parts
from tessera.weights.lazy import LazyTensor

BLOCK = 32
Q4_0, Q4_1 = 2, 3  # gguf.GGMLQuantizationType values
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20}


def is_q4(tensor_type: int) -> bool:
    return tensor_type in _BLOCK_BYTES


def q4_parts(tensor_type: int, rows: np.ndarray, k: int) -> Int4Parts:
    """(codes, d, m) of `rows` [n, bytes per row] of a Q4_0 / Q4_1 matrix with `k` columns."""
    n, groups = rows.shape[0], k // BLOCK
    blocks = torch.from_numpy(np.array(rows, dtype=np.uint8))  # (a copy: the map is read-only)
    blocks = blocks.view(n, groups, _BLOCK_BYTES[tensor_type])
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, groups)
    if tensor_type == Q4_1:
        m, nibbles = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, groups), blocks[..., 4:]
    else:
        m, nibbles = d * -8, blocks[..., 2:]
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=2).reshape(n, k)
    return codes, d, m


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
        default); None where the columns split a block, or an offset overflows float16."""
        r0, nr = rows or (0, self.shape[0])
        c0, nc = cols or (0, self.shape[1])
        if c0 % BLOCK or nc % BLOCK:
            return None
        width = _BLOCK_BYTES[self.tensor_type]
        data = self.data[r0:r0 + nr, c0 // BLOCK * width:(c0 + nc) // BLOCK * width]
        codes, d, m = q4_parts(self.tensor_type, data, nc)
        return (codes, d, m) if bool(torch.isfinite(m).all()) else None

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.load().narrow(dim, start, length)
        return _dequantized(q4_parts(self.tensor_type, self.data[start:start + length], self.shape[1]))

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


def _dequantized(parts: Int4Parts) -> torch.Tensor:
    """float32 values as the `gguf` package dequantizes them (d * q + m; for Q4_0
    d * q - 8 d, the same value exactly)."""
    codes, d, m = parts
    n, k = codes.shape
    w = codes.view(n, k // BLOCK, BLOCK).float() * d.float().unsqueeze(2) + m.float().unsqueeze(2)
    return w.reshape(n, k)
