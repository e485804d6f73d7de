"""Programmatic dependent launch (PDL, Hopper and later), opt-in: TESSERA_PDL=1.

A decode step is hundreds of short kernels; in a CUDA graph each still waits for the one
before to finish and drain before it is scheduled (~0.65 us between kernels on an H200,
docs/benchmarks.md, session 30). Launched with PDL, a kernel is scheduled while the one
before is still running, once every program of that one has started; its programs wait at
their first instruction (griddepcontrol.wait) until that kernel has finished and its
writes are visible. Every kernel taking part waits before touching memory that a kernel
writes, so the order of reads and writes is the stream's, transitively: a kernel finishes
only after its own wait. (Weights, which no kernel writes, may be read before: the few-row
linear hints its first stages into L2 there, prefetch.py.) Kernels without PDL (cuBLAS,
torch's) keep plain stream order on both sides.

Off by default until a GPU run has checked and measured it; `launch_options` gives the
launch keywords (the kernels' PDL constexpr, Triton's launch_pdl) for a tensor's device.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

FLAG = "TESSERA_PDL"


def requested() -> bool:
    """TESSERA_PDL: "1" on, "0" or unset off; anything else is an error."""
    value = os.environ.get(FLAG, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FLAG} must be 0 or 1, got {value!r}")
    return value == "1"


@lru_cache(maxsize=None)
def _enabled(device: torch.device) -> bool:
    return device.type == "cuda" and requested() and torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(t: torch.Tensor, forced: bool | None = None) -> dict:
    """Keywords for a launch on `t`'s device: PDL (the kernels' constexpr) and, where it is
    on, launch_pdl. `forced` overrides (the compile checks, which run without a GPU)."""
    on = _enabled(t.device) if forced is None else forced
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
