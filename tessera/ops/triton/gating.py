"""A gated MLP's activation inside Triton kernels (activation.py, and the few-row linear
that applies it while loading its input: skinny_linear.py): act(gate) rounded to the model
dtype, times up, in float32, as the torch ops compute it, so both kernels give the same
values.

Imports triton: only kernel factories import it, as a module global (see fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def gated(gate, up, ACT: tl.constexpr):
    """silu (ACT 1) or tanh-approximated gelu (ACT 2) of `gate`, rounded to its dtype,
    times `up`: float32."""
    g = gate.to(tl.float32)
    if ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) * (g + 0.044715 g^3)
        act = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * inner)))      # 0.5 g (1 + tanh(inner))
    else:
        act = g / (1.0 + tl.exp(-g))
    return act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
