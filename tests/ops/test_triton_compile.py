"""Every Triton kernel compiles to a cubin for Hopper (and Ampere) at real model shapes, within
the SM's shared memory, and the bf16 kernels keep everything in registers on Hopper.
No GPU needed: see tests/ops/triton_compile.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.ops.triton_compile import (SHAPES, SHARED_LIMIT, attention_variants, compile_all,
                                      compile_linear_attention, compile_mxfp4, compile_skinny,
                                      compile_ssm_scan)


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
                       "rms_norm_kernel", "gated_kernel", "rotary_kernel", "rotary_kv_write_kernel"}
    for r in results:
        assert r.shared <= SHARED_LIMIT[arch], r
        if no_spills:
            assert r.spilled == 0, r


def test_bf16_kernels_compile_for_hopper_without_spills():
    results = compile_all(90, (torch.bfloat16,), TESTED)
    assert {r.case.split()[0] for r in results} == {s.name for s in TESTED}
    _check(results, 90, no_spills=True)
    # decode attention merges its partitions in the same launch (the last program to arrive,
    # after a barrier and an acquire-release add) but where one program would merge the
    # 64 or 128 heads of one KV head (merge_kernel spreads them)
    fused = {r.case.split()[0] for r in results if r.kernel == "partial_kernel" and r.ordered_arrivals == 1}
    assert fused == {s.name for s in TESTED} - {"mqa-64", "deepseek-v3-mla"}, fused


def test_decode_kernels_compile_for_programmatic_dependent_launch():
    """With TESSERA_PDL (tessera/ops/triton/launch.py) every kernel of a decode step (all
    but prefill's) waits for the kernel before it in its PTX (griddepcontrol.wait, once);
    without it, none does. The few-row linears first hint their pipeline's first stages of
    weight into L2 (prefetch.py), ahead of the wait."""
    shapes = tuple(s for s in SHAPES if s.name == "llama-3-8b")
    with_pdl = compile_all(90, (torch.bfloat16,), shapes, pdl=True)
    _check(with_pdl, 90, no_spills=True)
    decode = [r for r in with_pdl if r.kernel != "prefill_kernel"]  # prefill keeps stream order
    assert all(r.pdl_waits == 1 for r in decode), [r for r in decode if r.pdl_waits != 1]
    assert all(r.pdl_waits == 0 for r in compile_all(90, (torch.bfloat16,), shapes)), "waits without PDL"
    linears = compile_skinny(90, SHAPES[1], pdl=True)  # SmolLM2's: few candidates
    assert linears and all(r.pdl_waits == 1 and r.spilled == 0 for r in linears), linears
    assert all(r.prefetches_before_wait > 0 for r in linears), linears
    assert not any(r.prefetches_before_wait for r in compile_skinny(90, SHAPES[1])), "prefetches without PDL"


def test_float32_and_ampere_kernels_compile():
    small = tuple(s for s in SHAPES if s.name in ("llama-3-8b", "smollm2-135m"))
    float32 = compile_all(90, (torch.float32,), small[:1])
    _check(float32, 90, no_spills=True)
    # rotary matches torch's separate multiplies and add bit for bit only unfused (an H200
    # run found 346 of 1536 float32 values off while the compiler made FMAs of them)
    rotary = [r for r in float32 if r.kernel in ("rotary_kernel", "rotary_kv_write_kernel")]
    assert len(rotary) == 2 and all(r.fused_multiply_adds == 0 for r in rotary), rotary
    _check(compile_all(80, (torch.bfloat16, torch.float32), small), 80, no_spills=False)


def test_fp8_cache_kernels_compile_for_hopper():
    """With an 8-bit float KV cache (e4m3fn) in a bf16 model: every kernel compiles within
    the SM's shared memory with no spills, and the attention kernels widen the cache with
    Hopper's fp8 conversions (cvt ... e4m3x2 in the PTX; on an H100 the integer decoding,
    kept for older GPUs, made fp8 decode slower than bf16's); the integer decoding still
    compiles there (its gemma-2 256-wide prefill spills a little: limits only). Decode
    multiplies in float16 (paged_decode.py's HALF_DOTS): no value goes on to bf16 (one more
    conversion each, which made the kernel slower than reading the cache at batch 256)."""
    results = compile_all(90, (torch.bfloat16,), TESTED, kv_dtype=torch.float8_e4m3fn)
    _check(results, 90, no_spills=True)
    attention = [r for r in results if r.kernel in ("partial_kernel", "prefill_kernel")]
    assert attention and all(r.fp8_conversions > 0 for r in attention), attention
    wide = {s.name for s in TESTED if s.head_size > 256}  # keep bf16: MLA's latent, Gemma 4's global heads
    decode = [r for r in attention if r.kernel == "partial_kernel" and r.case.split()[0] not in wide]
    assert decode and all(r.half_to_bf16 == 0 for r in decode), decode
    assert all(r.half_to_bf16 > 0 for r in attention if r.kernel == "partial_kernel" and r.case.split()[0] in wide)
    assert any(r.half_to_bf16 > 0 for r in attention if r.kernel == "prefill_kernel")  # the count sees them
    integer = compile_all(90, (torch.bfloat16,), TESTED, kv_dtype=torch.float8_e4m3fn, hardware_fp8=False)
    _check(integer, 90, no_spills=False)
    assert all(r.fp8_conversions == 0 for r in integer)
    # e5m2 differs only in constants (its widening to f16 is a byte move: no cvt to see)
    _check(compile_all(90, (torch.bfloat16,), TESTED[:1], kv_dtype=torch.float8_e5m2), 90, no_spills=True)


def test_fp8_cache_float32_and_ampere_kernels_compile():
    """float32 models widen an fp8 cache to float32 (their IEEE tl.dot): they compile, as
    do Ampere's kernels; spills are not asserted (float32 with fp8 spills on Hopper)."""
    small = tuple(s for s in SHAPES if s.name == "smollm2-135m")
    _check(compile_all(90, (torch.float32,), small, kv_dtype=torch.float8_e5m2), 90, no_spills=False)
    _check(compile_all(80, (torch.bfloat16,), small, kv_dtype=torch.float8_e4m3fn), 80, no_spills=False)


def test_attention_compiles_once_for_every_step_shape():
    """Lengths, table widths, partition counts and the decode rows before a prefill change
    every step: left unspecialised, one compile serves them all (Triton would otherwise
    compile a variant for each value that is 1 or a multiple of 16: 17 of the decode
    kernel, a second or so each, in the middle of serving). These steps' partitions are
    few enough to merge in the partition kernel, so merge_kernel never runs."""
    for shape in (SHAPES[0], SHAPES[4]):  # plain, and windowed with soft-capping
        for kv_dtype in (None, torch.float8_e4m3fn):
            assert attention_variants(shape, kv_dtype=kv_dtype) == {"partial_kernel": 1,
                                                                    "prefill_kernel": 1}, kv_dtype


def test_few_row_linear_candidates_compile_for_hopper_on_tensor_cores():
    """Every tile and split the few-row linear may time on an H100 compiles at Llama-3-8B's
    and SmolLM2's projections with no spills within the SM's shared memory, streams its
    weight through cp.async stages, and multiplies on Hopper's wgmma where its tile has the
    64 rows that needs (mma.sync below): a tile that fell back to scalar FMAs would be
    timed, lose to cuBLAS and never be chosen, and this says so first. Split-K adds its
    parts in the same launch."""
    for shape in (s for s in SHAPES if s.name in ("llama-3-8b", "smollm2-135m")):
        results = compile_skinny(90, shape)
        kernels = [r for r in results if r.kernel == "skinny_kernel"]
        assert {r.case.split()[1] for r in kernels} == {"qkv", "o", "gate_up", "down", "down_gated", "qkv_normed",
                                                         "gate_up_normed"}
        assert any("split1" not in r.case for r in kernels)  # split-K candidates exist
        for r in results:
            assert r.shared <= SHARED_LIMIT[90] and r.spilled == 0, r
        for r in kernels:
            wide = int(r.case.split()[3].removeprefix("n")) >= 64
            assert r.matrix_ops == ("wgmma" if wide else "mma.sync"), r
            assert r.async_copies > 0, r
        # one kernel: a tile's last split program sums the parts, after a barrier and an
        # acquire-release arrival (tessera/ops/triton/semaphores.py); unsplit tiles have none
        assert {r.kernel for r in results} == {"skinny_kernel"}
        for r in kernels:
            assert r.ordered_arrivals == (0 if "split1 " in r.case else 1), r


def test_mxfp4_expert_linear_compiles_for_hopper_on_tensor_cores():
    """gpt-oss's packed experts: the kernel that decodes MXFP4 in registers compiles at
    gpt-oss-20b's projections, within the SM's shared memory, without spills, and multiplies
    on the matrix unit (a decode that fell back to scalar FMAs would show here first)."""
    results = compile_mxfp4(90)
    assert len(results) == 4
    for r in results:
        assert r.shared <= SHARED_LIMIT[90] and r.spilled == 0 and r.matrix_ops, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_attention_kernels_compile_for_hopper_without_spills(dtype):
    """Qwen3.5's Gated DeltaNet kernels (conv decode, prefill and state hand-over; the
    fused recurrent delta rule) at its real shapes."""
    results = compile_linear_attention(90, dtype)
    assert {r.kernel for r in results} == {"conv_decode_kernel", "conv_prefill_kernel", "conv_state_kernel",
                                           "gated_delta_kernel"}
    for r in results:
        assert r.shared <= SHARED_LIMIT[90] and r.spilled == 0, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ssm_scan_kernels_compile_for_hopper_without_spills(dtype):
    """Mamba-2's fused recurrent scan at Granite 4.0-H's shapes, decode and prefill (its
    [BP, 128] float32 state tile held in registers)."""
    results = compile_ssm_scan(90, dtype)
    assert [r.kernel for r in results] == ["ssm_scan_kernel"] * 2
    for r in results:
        assert r.shared <= SHARED_LIMIT[90] and r.spilled == 0, r
