"""The Triton kernels with an 8-bit float KV cache (--kv-cache-dtype fp8, kv_quant.py), e4m3fn
and e5m2, through Triton's interpreter on CPU: every fp8 code decoded exactly; kv_write bit
for bit what kv_quant.quantize_kv stores (random magnitudes, exact ties, subnormals, inf,
NaN, saturation; padded rows untouched); paged decode and prefill against the torch ops on
the same fp8 cache with float32 and bf16 queries. Skipped without triton; on a GPU machine
the cases also run on the device.

Each test runs its check in a subprocess (`python -m tests.ops.test_triton_fp8_kv CHECK
DEVICE`): Triton reads TRITON_INTERPRET when a kernel is built, and other tests in this
process may already have built them for a GPU target (tests/ops/test_triton_kernels.py)."""
from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.ops.attention.kv_quant import FP8_FORMATS, QUANTIZED_KV, quantize_kv
from tessera.ops.registry import OpSpec, select_op

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


def _run_check(name: str, device: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1" if device == "cpu" else "0"}
    result = subprocess.run([sys.executable, "-m", "tests.ops.test_triton_fp8_kv", name, device],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{name} OK" in result.stdout


# ---- the checks, run in the subprocess ----

def _widen_bf16_dot_operands() -> None:
    """Triton 3.9's interpreter multiplies bf16 tl.dot operands as their raw uint16 storage
    (tests/ops/triton_attention_cases.py hence runs attention in float32 only). Widened to float32
    first, exactly, the product is what a GPU's bf16 dot computes: exact products summed in
    float32."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = widened


def _meta_to(meta, device: str):
    for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


def _fp8_case(specs, fp8: torch.dtype, *, block_size: int, num_heads: int, num_kv_heads: int,
              head_size: int, seed: int):
    """tests/ops/test_attention.make_case with the caches in `fp8` (earlier tokens and the
    out-of-context filler rounded) and this step's K/V written by the reference."""
    from tests.ops.test_attention import make_case
    from tessera.ops.attention.torch_paged import kv_write_ref

    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=seed)
    # spread the magnitudes so subnormal and large codes turn up too; the filler outside
    # every context (50 and -80) stays large, so reading it shows
    g = torch.Generator().manual_seed(seed)
    for name, filler in (("k_cache", 50.0), ("v_cache", -80.0), ("key", None), ("value", None)):
        x = getattr(case, name)
        factor = torch.exp2(torch.randint(-12, 4, x.shape, generator=g).float())
        setattr(case, name, x * factor if filler is None else torch.where(x == filler, x, x * factor))
    case.k_cache, case.v_cache = quantize_kv(case.k_cache, fp8), quantize_kv(case.v_cache, fp8)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    return case


def _widenings(device: str) -> tuple[bool | None, ...]:
    """How the kernels widen fp8 under test: by integer ops (False) and by the fp8 type's
    conversions (the GPU's own from sm_89 on; the interpreter's, exact for finite codes),
    which on a GPU is the automatic choice (None) so that an older GPU keeps integer ops."""
    return (False, True) if device == "cpu" else (False, None)


def _assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Both read the same cache, widened exactly. float32: equal up to float32 arithmetic
    (on a GPU the kernels' exp is the hardware's approximate exp2, and tl.dot sums in its own
    order: an H200 prefill with soft-capping came 2.8e-5 off). bf16: up to bf16 roundings of
    the probabilities and outputs (the interpreter rounds float32 -> bf16 toward zero, so they
    drift further there), relative to the output's scale, which the spread magnitudes make large."""
    limit = 1e-4 if want.dtype == torch.float32 else 2 ** -6
    err = ((got.cpu().float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < limit, (what, err)


def check_decode_codes(device: str) -> None:
    """All 256 codes of each format widened as load_kv does (float32 and bf16), by both
    widenings (_widenings), equal torch's conversion bit for bit (-0 included), inf and NaN
    as inf and NaN (but e4m3fn's NaN through the interpreter's fp8 type, which reads it as
    480); masked lanes read 0."""
    from tessera.ops.triton.paged_decode import fp8_in_hardware

    import triton
    import triton.language as tl

    global fp8  # a module global: the interpreter does not see this function's locals
    from tessera.ops.triton import fp8

    @triton.jit
    def widen(src_ptr, like_ptr, out_ptr, KV_FORMAT: tl.constexpr, HW_FP8: tl.constexpr):
        i = tl.arange(0, 512)
        like = tl.load(like_ptr + i * 0)
        x = fp8.load_kv(src_ptr + i, i < 256, like, KV_FORMAT, True, HW_FP8)
        tl.store(out_ptr + i, x)

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for hw in (fp8_in_hardware(codes.to(device), forced) for forced in _widenings(device)):
        for fp8_dtype, fmt in FP8_FORMATS.items():
            for dtype in (torch.float32, torch.bfloat16):
                what = (fp8_dtype, dtype, "fp8 type" if hw else "integer ops")
                want = codes.view(fp8_dtype).to(dtype)
                out = torch.full((512,), 7.0, dtype=dtype, device=device)
                src = torch.cat([codes, codes]).to(device)  # past 256: masked, must read 0
                widen[(1,)](src, torch.zeros(1, dtype=dtype, device=device), out, KV_FORMAT=fmt, HW_FP8=hw)
                got = out.cpu()
                finite = want.isfinite()
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                assert torch.equal(got[:256][finite].view(bits), want[finite].view(bits)), what
                assert torch.equal(got[256:], torch.zeros(256, dtype=dtype)), (*what, "masked lanes")
                if hw and device == "cpu" and fp8_dtype == torch.float8_e4m3fn:
                    continue
                assert torch.equal(got[:256].isnan(), want.isnan()), (*what, "NaN codes")
                assert torch.equal(got[:256][want.isinf()], want[want.isinf()]), (*what, "inf codes")


def _encode_values(fp8: torch.dtype) -> torch.Tensor:
    """float32 values that probe every rounding case of `fp8`, both signs."""
    g = torch.Generator().manual_seed(7)
    info = torch.finfo(fp8)
    mant = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8]
    codes = torch.arange(0, 0x80, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    finite = codes[codes.isfinite() & (codes <= info.max)]  # 0, subnormals, normals up to max
    ties = (finite[1:] + finite[:-1]) / 2                   # exactly halfway: to even
    near = torch.cat([torch.nextafter(ties, torch.zeros(())), torch.nextafter(ties, torch.full((), 1e30))])
    tiny = info.smallest_normal
    special = torch.tensor([0.0, float("inf"), float("nan"), info.max, info.max * 1.0001, info.max * 1.07,
                            info.max * 2, 1e30, 3e38, tiny, tiny * (1 - 2 ** -20), tiny * 0.99,
                            tiny * (1 - 2 ** -(mant + 2)), tiny / 2 ** mant / 2,
                            tiny / 2 ** mant / 2 * (1 + 2 ** -20), 1e-40, 1e-30])
    magnitudes = torch.exp(torch.empty(4000).uniform_(torch.log(torch.tensor(1e-9)).item(),
                                                      torch.log(torch.tensor(1e6)).item(), generator=g))
    x = torch.cat([finite, ties, near, special, magnitudes])
    return torch.cat([x, -x])


def check_kv_write(device: str) -> None:
    """Rows from float32, bf16 and fp16 keys/values, each value as quantize_kv rounds it;
    slot -1 writes nothing and other slots keep their bytes."""
    from tessera.ops.triton.kv_write import triton_kv_write

    heads, size = 2, 40  # rows of 80: a partial BLOCK
    for fp8_dtype in QUANTIZED_KV:
        values = _encode_values(fp8_dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = values.to(dtype)
            pad = (-x.numel()) % (2 * heads * size)
            x = torch.cat([x, x[:pad].flip(0)]).view(-1, heads, size)
            key, value = x[0::2], -x[1::2]
            tokens = key.shape[0]
            slots = torch.randperm(tokens + 8, generator=torch.Generator().manual_seed(tokens))[:tokens]
            slots[3] = -1  # a padded row
            g = torch.Generator().manual_seed(1)
            # [blocks, block_size, heads, size], random bytes everywhere beforehand
            shape = ((tokens + 8) // 4 + 1, 4, heads, size)
            k_bytes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
            v_bytes = torch.randint(0, 256, k_bytes.shape, dtype=torch.uint8, generator=g)
            k_cache, v_cache = k_bytes.clone().view(fp8_dtype), v_bytes.clone().view(fp8_dtype)
            k_got, v_got = k_cache.to(device), v_cache.to(device)
            triton_kv_write(key.to(device), value.to(device), k_got, v_got, slots.to(device), True)
            for got, before, rows in ((k_got, k_bytes, key), (v_got, v_bytes, value)):
                want = before.view(-1, heads, size).clone()
                keep = slots >= 0
                want[slots[keep]] = quantize_kv(rows[keep], fp8_dtype).view(torch.uint8)
                got = got.cpu().view(torch.uint8).view(-1, heads, size)
                # a NaN's sign is not kept: a GPU's half -> float conversion makes -NaN +NaN
                both_nan = got.view(fp8_dtype).float().isnan() & want.view(fp8_dtype).float().isnan()
                bad = ((got != want) & ~both_nan).nonzero()
                assert bad.numel() == 0, (fp8_dtype, dtype, bad[:5].tolist(), got[tuple(bad[0])].item(),
                                          want[tuple(bad[0])].item())


def check_paged_decode(device: str) -> None:
    """GQA (groups of 3), block sizes 4 and 16, a sliding window, soft-capping, and a
    context split over partitions of 16 (forced) and merged, per format and query dtype,
    both widenings (_widenings)."""
    from tessera.ops.attention.torch_paged import paged_decode_ref
    from tessera.ops.triton.paged_decode import triton_paged_decode

    for hw, fp8_dtype in itertools.product(_widenings(device), QUANTIZED_KV):
        for dtype in (torch.float32, torch.bfloat16):
            for block_size, window, softcap, partition in ((4, None, None, None), (16, 5, None, 16),
                                                           (16, None, 2.0, 16), (4, 20, 1.5, None)):
                case = _fp8_case([(37, 1), (1, 1), (70, 1)], fp8_dtype, block_size=block_size, num_heads=6,
                                 num_kv_heads=2, head_size=32, seed=block_size + (window or 0))
                query = case.query.to(dtype)
                want = paged_decode_ref(query, case.k_cache, case.v_cache, case.meta, case.scale, window, softcap)
                got = triton_paged_decode(query.to(device), case.k_cache.to(device), case.v_cache.to(device),
                                          _meta_to(case.meta, device), case.scale, window, softcap,
                                          partition_size=partition, hardware_fp8=hw)
                _assert_close(got, want, (fp8_dtype, dtype, block_size, window, softcap, partition, hw))


def check_paged_prefill(device: str) -> None:
    """A decode, then a 24-token chunk over 16 cached tokens and a fresh 17-token prompt,
    all read from the fp8 cache (the fresh prompt's too, as the reference does); a window
    and soft-capping once each; both widenings (_widenings)."""
    from tessera.ops.attention.torch_paged import paged_prefill_ref
    from tessera.ops.triton.paged_prefill import triton_paged_prefill

    for hw, fp8_dtype in itertools.product(_widenings(device), QUANTIZED_KV):
        for dtype in (torch.float32, torch.bfloat16):
            for block_size, window, softcap in ((4, None, None), (16, 6, 2.0)):
                case = _fp8_case([(20, 1), (40, 24), (17, 17)], fp8_dtype, block_size=block_size, num_heads=4,
                                 num_kv_heads=2, head_size=32, seed=block_size)
                nd = case.meta.num_decodes
                query, key, value = case.query[nd:].to(dtype), case.key[nd:].to(dtype), case.value[nd:].to(dtype)
                want = paged_prefill_ref(query, key, value, case.k_cache, case.v_cache, case.meta, case.scale,
                                         window, softcap)
                got = triton_paged_prefill(query.to(device), key.to(device), value.to(device),
                                           case.k_cache.to(device), case.v_cache.to(device),
                                           _meta_to(case.meta, device), case.scale, window, softcap,
                                           hardware_fp8=hw)
                _assert_close(got, want, (fp8_dtype, dtype, block_size, window, softcap, hw))


CHECKS = {f.__name__: f for f in (check_decode_codes, check_kv_write, check_paged_decode, check_paged_prefill)}


# ---- the tests ----

@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", list(CHECKS))
def test_fp8_cache_kernel_matches_torch(check, device):
    """check_decode_codes: every code widens exactly; check_kv_write: rounds bit for bit as
    quantize_kv; check_paged_decode / check_paged_prefill: attention over the fp8 cache
    equals the torch reference's on the same bytes."""
    _run_check(check, device)


def test_the_gpus_fp8_conversions_are_used_from_compute_capability_8_9(monkeypatch):
    """Ada and Hopper convert fp8 themselves; Ampere and the CPU (interpreter) decode the
    bytes with integer ops; tests may force either."""
    from types import SimpleNamespace

    from tessera.ops.triton.paged_decode import fp8_in_hardware

    gpu = SimpleNamespace(is_cuda=True, device="cuda:0")
    for capability, expected in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert fp8_in_hardware(gpu) is expected, capability
    cpu = torch.zeros(1, dtype=torch.uint8)
    assert fp8_in_hardware(cpu) is False
    assert fp8_in_hardware(cpu, forced=True) is True and fp8_in_hardware(gpu, forced=False) is False


@pytest.mark.parametrize("fp8_dtype", QUANTIZED_KV)
def test_cuda_lookups_choose_triton_for_fp8_caches(fp8_dtype):
    have = importlib.util.find_spec("triton") is not None
    for kind, phase, name in (("kv_write", None, "kv_write"), ("paged_attention", "decode", "paged_decode"),
                              ("paged_attention", "prefill", "paged_prefill")):
        choice = select_op(OpSpec(kind, "cuda", torch.bfloat16, phase=phase, kv_dtype=fp8_dtype))
        want = f"triton_{name}" if have else ("torch_kv_write" if kind == "kv_write" else f"torch_{name}")
        assert choice.builder.name == want, (kind, phase, choice.rejected)


if __name__ == "__main__":
    check, dev = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
    if dev == "cpu":
        _widen_bf16_dot_operands()
    CHECKS[check](dev)
    print(f"{check} OK")
