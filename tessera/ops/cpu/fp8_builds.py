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
    """Why the build for a spec's cache format cannot run here. The registry asks every
    builder for its reasons, a spec without an fp8 cache too (`kv_dtypes` already rejects
    that one): it gets none from here."""
    def check(spec: OpSpec) -> list[str]:
        if spec.kv_dtype not in builds:
            return []
        return (f16c_missing() if needs_f16c else []) or builds[spec.kv_dtype].check(spec)
    return check
