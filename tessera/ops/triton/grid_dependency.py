"""The first step of every kernel that may be launched with PDL (launch.py): wait for the
kernel before it to finish (its writes visible), then let the next one be scheduled.

Imports triton: only kernel factories import it, as a module global (see fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda


@triton.jit
def start(PDL: tl.constexpr):
    if PDL:
        cuda.gdc_wait()
        cuda.gdc_launch_dependents()
