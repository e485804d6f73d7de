"""Rounding float32 to a narrower model dtype inside Triton kernels, kept in float32, for
kernels that must round each intermediate as torch's ops do. bf16 is rounded on the bits:
on an H100 `.to(bf16).to(float32)` round trips did not round (a kernel meant to round twice
matched rounding once), and Triton's interpreter converts toward zero rather than to nearest.

Imports triton: only kernel factories import it, as a module global (see fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, ROUND_BF16: tl.constexpr, dt: tl.constexpr):
    """float32 x rounded to `dt` (nearest, ties to even), as float32."""
    if ROUND_BF16:  # overflow rounds to inf; a NaN (whose payload the carry could wipe:
        # a GPU's canonical NaN is 0x7fffffff) becomes the quiet NaN torch gives
        bits = x.to(tl.int32, bitcast=True)
        rounded_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        rounded_bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, rounded_bits)
        return rounded_bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)
