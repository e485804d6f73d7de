"""MXFP4 tensors of a GGUF (llama.cpp's type 39, gpt-oss's experts) in the layout tessera's
MXFP4 stacks hold (OpenAI's: weights/mxfp4.py), so they stay packed.

llama.cpp stores each block of 32 values as 17 bytes: the E8M0 scale, then 16 bytes whose
low nibbles are values 0-15 and high nibbles values 16-31. OpenAI's `_blocks` hold the
values in order, two a byte (the low nibble first), and the scales apart. The codes and
scales are the same numbers; only where they sit differs."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

MXFP4 = 39  # gguf.GGMLQuantizationType.MXFP4
BLOCK_BYTES = 17


def mxfp4_parts(name: str, data: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
    """`name` (".weight" last) and the stored rows [..., groups * 17] -> (name_blocks,
    [..., groups, 16] uint8) and (name_scales, [..., groups] uint8)."""
    if data.dtype != np.uint8 or data.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"{name}: MXFP4 rows of {data.shape[-1]} {data.dtype} bytes are not whole 17-byte blocks")
    blocks = data.reshape(*data.shape[:-1], -1, BLOCK_BYTES)
    codes = blocks[..., 1:]
    values = np.concatenate((codes & 0x0F, codes >> 4), axis=-1)  # the 32 codes in order
    base = name.removesuffix(".weight")
    yield f"{base}_blocks", torch.from_numpy(np.ascontiguousarray(values[..., 0::2] | (values[..., 1::2] << 4)))
    yield f"{base}_scales", torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
