"""Every Triton kernel compiles to a cubin for Hopper (and Ampere) at real model shapes, within
the SM's shared memory, and the bf16 kernels keep everything in registers on Hopper.
No GPU needed: see tests/ops/triton_compile.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.ops.triton_compile import SHAPES, SHARED_LIMIT, attention_variants, compile_all


def _nvidia_backend_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90).path
    except Exception as exc:  # noqa: BLE001 - any missing piece: nothing to compile with
        return f"triton's NVIDIA backend / ptxas is unavailable: {exc}"
    return None


pytestmark = pytest.mark.skipif(_nvidia_backend_missing() is not None,
                                reason=_nvidia_backend_missing() or "")

# qwen2-7b has llama's tile shapes; the rest each add something (head 64 / 96 / 256,
# soft-capping and a window, a group of 64 query heads)
TESTED = tuple(s for s in SHAPES if s.name != "qwen2-7b")


def _check(results, arch: int, no_spills: bool) -> None:
    kernels = {r.kernel for r in results}
    assert kernels == {"kv_write_kernel", "partial_kernel", "merge_kernel", "prefill_kernel",
                       "rms_norm_kernel", "gated_kernel", "rotary_kernel"}
    for r in results:
        assert r.shared <= SHARED_LIMIT[arch], r
        if no_spills:
            assert r.spilled == 0, r


def test_bf16_kernels_compile_for_hopper_without_spills():
    results = compile_all(90, (torch.bfloat16,), TESTED)
    assert {r.case.split()[0] for r in results} == {s.name for s in TESTED}
    _check(results, 90, no_spills=True)


def test_float32_and_ampere_kernels_compile():
    small = tuple(s for s in SHAPES if s.name in ("llama-3-8b", "smollm2-135m"))
    _check(compile_all(90, (torch.float32,), small[:1]), 90, no_spills=True)
    _check(compile_all(80, (torch.bfloat16, torch.float32), small), 80, no_spills=False)


def test_attention_compiles_once_for_every_step_shape():
    """Lengths, table widths, partition counts and the decode rows before a prefill change
    every step: left unspecialised, one compile serves them all (Triton would otherwise
    compile a variant for each value that is 1 or a multiple of 16: 17 of the decode
    kernel, a second or so each, in the middle of serving)."""
    for shape in (SHAPES[0], SHAPES[4]):  # plain, and windowed with soft-capping
        assert attention_variants(shape) == {"partial_kernel": 1, "merge_kernel": 1, "prefill_kernel": 1}
