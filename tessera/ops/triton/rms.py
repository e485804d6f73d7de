"""RMSNorm's arithmetic inside Triton kernels: the norm's own kernel (rms_norm.py) and the
few-row linear that normalises its input while loading it (skinny_linear.py), so both
round where the torch op does (tessera/ops/norm.py) and give the same values.

Imports triton: only kernel factories import it, as a module global (see fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def residual_sum(x, r):
    """x + r, rounded to x's dtype: the next residual."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def inverse_rms(squares, hidden, eps):
    """1 / sqrt(mean square + eps) from a row's float32 sum of squares."""
    return tl.rsqrt(squares / hidden + eps)


@triton.jit
def weighted(x, rstd, w, ROUND_NORMED: tl.constexpr):
    """w * (x * rstd) in float32; the normalised x rounded to its dtype first where
    ROUND_NORMED (a weight in the model dtype; not a float32 one over a lower precision)."""
    normed = x.to(tl.float32) * rstd
    if ROUND_NORMED:
        normed = normed.to(x.dtype).to(tl.float32)
    return w.to(tl.float32) * normed
