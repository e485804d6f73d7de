"""MXFP4 (OCP microscaling FP4), the format gpt-oss ships its expert weights in.

A weight row is stored in blocks of 32 values: 16 bytes of 4-bit E2M1 codes (two per byte,
the low nibble first) and one E8M0 scale byte (a power of two, biased by 127). Checkpoints
name the two parts `<weight>_blocks` [..., rows, blocks, 16] and `<weight>_scales`
[..., rows, blocks]; rows are the output features, so a dequantized expert stack is
[E, out, in], which transformers hands its modules transposed ([E, in, out])."""
from __future__ import annotations

import torch

# E2M1: sign, two exponent bits, one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     rows_per_chunk: int = 1 << 16) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] of `dtype`, in chunks
    of rows so the temporary index tensors stay small."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(blocks: [..., groups, {BLOCK // 2}], scales: [..., groups])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    *lead, groups, _ = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK // 2), scales.reshape(-1, 1)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype)
    for start in range(0, flat_blocks.shape[0], rows_per_chunk):
        chunk = flat_blocks[start:start + rows_per_chunk]
        values = torch.stack((lut[(chunk & 0x0F).long()], lut[(chunk >> 4).long()]), dim=-1).flatten(1)
        exponent = flat_scales[start:start + rows_per_chunk].to(torch.int32) - SCALE_BIAS
        out[start:start + rows_per_chunk] = torch.ldexp(values, exponent).to(dtype)
    return out.view(*lead, groups * BLOCK)
