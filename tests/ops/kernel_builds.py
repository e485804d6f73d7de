"""The two builds of a compact-weight GEMM (linear_int8, linear_int4): the AVX512 one, and on
CPUs with AMX the AMX one (its widened rows on tiles); a test's `build` fixture runs on each."""
from __future__ import annotations

from types import ModuleType

import pytest


def avx512_or_amx(request, monkeypatch, module: ModuleType) -> str:
    """request.param "amx": `module`'s AMX build (skipped where none runs); "avx512": the
    AVX512 build on every host."""
    if request.param == "amx":
        if module.amx_kernel() is None:
            pytest.skip("no AMX, or its build does not compile")
    else:
        monkeypatch.setattr(module, "amx_kernel", lambda: None)
    return request.param
