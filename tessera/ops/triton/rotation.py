"""One head's rotate-half rotary step inside Triton kernels (rotary.py, rotary_kv_write.py),
rounding each product and the sum to the model dtype as torch's op does, so results match
it exactly (see rotary.py for why bf16 is rounded on the bits, and why the kernels that
use this compile without FP fusion).

Imports triton: only kernel factories import it, as a module global (see fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from tessera.ops.triton import rounding


@triton.jit
def rotate_head(src, cos_row, sin_row, half, BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The head at `src` (head_size = 2 * half values) rotated by this token's cos / sin
    rows: its two halves in the head's dtype, their offsets and mask."""
    i = tl.arange(0, BLOCK_H)
    mask = i < half
    x1 = tl.load(src + i, mask=mask, other=0.0)
    x2 = tl.load(src + half + i, mask=mask, other=0.0)
    c1 = tl.load(cos_row + i, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + i, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + i, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + i, mask=mask, other=0.0).to(tl.float32)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded
    o1 = rounding.rounded(a1 * c1, ROUND_BF16, dt) + rounding.rounded(-a2 * s1, ROUND_BF16, dt)
    o2 = rounding.rounded(a2 * c2, ROUND_BF16, dt) + rounding.rounded(a1 * s2, ROUND_BF16, dt)
    return (rounding.rounded(o1, ROUND_BF16, dt).to(dt), rounding.rounded(o2, ROUND_BF16, dt).to(dt), i, mask)
