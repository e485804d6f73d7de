"""A C kernel built once per 8-bit KV cache format (TESSERA_KV_FP8: fp8.h, kv_rows.h), and
the registry check of the builders that run those builds."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tessera.ops.attention.kv_quant import FP8_FORMATS
from tessera.ops.cpu.build import Kernel, f16c_missing
from tessera.ops.registry import OpSpec


def fp8_builds(kernel: Kernel) -> dict[torch.dtype, Kernel]:
    """`kernel`'s source built per cache format: {cache dtype: that build}."""
    return {dtype: dataclasses.replace(kernel, defines=(f"TESSERA_KV_FP8 {code}",))
            for dtype, code in FP8_FORMATS.items()}


def fp8_check(builds: dict[torch.dtype, Kernel], *, needs_f16c: bool) -> Callable[[OpSpec], list[str]]:
    """Why the build for a spec's cache format cannot run here (the registry asks only
    for specs the builder's `kv_dtypes` admits: an fp8 cache)."""
    def check(spec: OpSpec) -> list[str]:
        return (f16c_missing() if needs_f16c else []) or builds[spec.kv_dtype].check(spec)
    return check
