"""Weights into L2 before a kernel launched with PDL waits for the one before (launch.py).

A few-row linear is a stream of weight reads, and each of its programs first spends a
memory round trip per pipeline stage filling its pipeline; on the H200 the short
projections streamed at 2.3-2.9 TB/s against 4.1 for the long ones, the ramp and tail being
a larger share of 15-18 us (docs/benchmarks.md, session 30). Launched with PDL, a program
may start while the kernel before is still running; the weights are never written by any
kernel, so reading them cannot race it, and hinting the first stages' lines into L2 then
overlaps the ramp with the kernel before. A hint changes no value: only timing.

Imports triton: only kernel factories import it, as a module global (see fp8.py)."""
from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)  # an L2 line: one prefetch covers it


@triton.jit
def lines_to_l2(ptrs, mask):
    """Hint the L2 lines holding `ptrs` (where `mask`) in from memory; no fault, no value."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def rows_to_l2(rows, row_ok, k_begin, k_end, ELEMENTS: tl.constexpr):
    """Columns k_begin to k_begin + ELEMENTS (a power of 2, at least a line's) of every
    row at `rows` (pointers to column 0, [R]), none at or past k_end: one hint a line."""
    LINE: tl.constexpr = LINE_BYTES * 8 // rows.dtype.element_ty.primitive_bitwidth
    k = k_begin + tl.arange(0, ELEMENTS // LINE) * LINE
    lines_to_l2(rows[:, None] + k[None, :], row_ok[:, None] & (k < k_end)[None, :])
