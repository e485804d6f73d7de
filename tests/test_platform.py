"""dtype `auto` on CPUs: bf16 wherever it is the faster choice (native bf16, or tessera's
AVX512 or AVX2 kernels), float32 where torch would emulate bf16 (the transformers fallback,
no compiler)."""
from __future__ import annotations

import pytest
import torch

from tessera import platform
from tessera.ops.cpu import build


@pytest.fixture
def fresh_reason():
    platform.cpu_bf16_reason.cache_clear()
    yield
    platform.cpu_bf16_reason.cache_clear()


def test_explicit_dtypes_and_cuda_are_taken_as_given():
    assert platform.resolve_dtype("float32", "cpu") == torch.float32
    assert platform.resolve_dtype("bfloat16", "cpu", tessera_ops=False) == torch.bfloat16
    assert platform.resolve_dtype("auto", "cuda") == torch.bfloat16


def test_native_bf16_is_bf16_on_every_path(monkeypatch, fresh_reason):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: True)
    assert platform.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert platform.resolve_dtype("auto", "cpu", tessera_ops=False) == torch.bfloat16


@pytest.mark.skipif(build.unavailable_reason("gemm_bf16.c") is not None,
                    reason=str(build.unavailable_reason("gemm_bf16.c")))
def test_without_native_bf16_the_avx512_kernels_make_bf16_the_default(monkeypatch, fresh_reason):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: False)
    assert platform.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert "AVX512 kernels" in platform.cpu_bf16_reason()
    # transformers' modules would run torch's emulated bf16
    assert platform.resolve_dtype("auto", "cpu", tessera_ops=False) == torch.float32


@pytest.mark.skipif(build.unavailable_reason("gemm_bf16_avx2.c") is not None,
                    reason=str(build.unavailable_reason("gemm_bf16_avx2.c")))
def test_avx2_only_cpus_take_bf16_through_the_avx2_kernels(monkeypatch, fresh_reason):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert platform.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert "AVX2 kernels" in platform.cpu_bf16_reason()
    # int8 and int4 weights run their own AVX2 kernels, on bf16 activations
    assert platform.resolve_dtype("auto", "cpu", quantization="int8") == torch.bfloat16
    assert platform.resolve_dtype("auto", "cpu", quantization="int4") == torch.bfloat16
    # transformers' modules would run torch's emulated bf16
    assert platform.resolve_dtype("auto", "cpu", tessera_ops=False) == torch.float32


def test_an_unknown_isa_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "AVX2")
    with pytest.raises(ValueError, match="avx512, avx2"):
        build.build_flags()


def test_without_a_compiler_auto_keeps_float32(monkeypatch, fresh_reason):
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(build, "compiler", lambda: None)
    build.load_kernel.cache_clear()
    try:
        assert platform.resolve_dtype("auto", "cpu") == torch.float32
    finally:
        build.load_kernel.cache_clear()


def fake_gpus(monkeypatch, capabilities: list[tuple[int, int]], hip: str | None = None) -> None:
    monkeypatch.delenv(platform.DEVICE_ENV, raising=False)  # the suite pins "auto" to the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capabilities))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])
    monkeypatch.setattr(torch.version, "hip", hip)


def test_auto_device_is_the_gpu_when_torch_sees_one_fit_to_run(monkeypatch):
    fake_gpus(monkeypatch, [])
    assert platform.resolve_device("auto") == "cpu"
    fake_gpus(monkeypatch, [(9, 0)])
    assert platform.resolve_device("auto") == "cuda"
    assert platform.resolve_device("auto", ranks=2) == "cpu"  # one GPU per tensor-parallel rank
    fake_gpus(monkeypatch, [(8, 0), (8, 6)])
    assert platform.resolve_device("auto", ranks=2) == "cuda"
    fake_gpus(monkeypatch, [(7, 5)])  # no bf16: asked for by name only
    assert platform.resolve_device("auto") == "cpu"
    fake_gpus(monkeypatch, [(9, 4)], hip="6.2")  # ROCm: untested, asked for by name only
    assert platform.resolve_device("auto") == "cpu"
    assert platform.resolve_device("cpu") == "cpu" and platform.resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setenv(platform.DEVICE_ENV, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.resolve_device("auto") == "cpu"  # what "auto" means, when set


def test_async_scheduling_is_on_by_default_on_cuda_unless_ruled_out(monkeypatch):
    """Configs only (no engine is built, so no GPU is needed): on for a CUDA device left to
    the default, off on CPU, off where speculation or several ranks rule it out, and an
    explicit choice always wins."""
    from tessera.llm import engine_config

    def chosen(**kwargs) -> bool:
        return engine_config(None, **kwargs).scheduler.async_scheduling

    assert chosen(device="cuda") and chosen(device="cuda:0")
    assert not chosen(device="cpu")
    assert not chosen(device="cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert not chosen(device="cuda", tensor_parallel_size=2)
    assert not chosen(device="cuda", async_scheduling=False)
    assert chosen(device="cpu", async_scheduling=True)
    fake_gpus(monkeypatch, [(9, 0)])
    config = engine_config(None)  # device "auto" on a machine with a GPU
    assert config.device == "cuda" and config.scheduler.async_scheduling
    assert config.scheduler.max_num_seqs == 256  # CUDA's scheduler defaults follow the device


@pytest.fixture
def int4_kernel(monkeypatch):
    """Whether the CPU's int4 kernel runs, as resolve_weights asks it (set per test)."""
    from tessera.ops.cpu import linear_int4

    def runs(yes: bool) -> None:
        monkeypatch.setattr(linear_int4, "kernel_unavailable", lambda spec=None: [] if yes else ["no kernel"])
    return runs


@pytest.fixture
def int8_kernel(monkeypatch):
    """Whether the CPU's int8 kernel runs, as resolve_weights asks it (set per test)."""
    from tessera.ops.cpu import linear_int8

    def runs(yes: bool) -> None:
        monkeypatch.setattr(linear_int8, "kernel_unavailable", lambda spec=None: [] if yes else ["no kernel"])
    return runs


def test_a_q4_gguf_runs_as_stored_in_int4_where_the_cpu_kernel_runs(int4_kernel):
    int4_kernel(True)
    for stored in ("Q4_0", "Q4_1", "Q4_K"):
        assert platform.resolve_weights("bfloat16", None, "cpu", True, stored) == (torch.bfloat16, "int4")
    # asked otherwise, or not a Q4_0 / Q4_1 file, or not tessera's CPU kernel with bf16
    assert platform.resolve_weights("bfloat16", "none", "cpu", True, "Q4_1") == (torch.bfloat16, None)
    assert platform.resolve_weights("bfloat16", "int8", "cpu", True, "Q4_1") == (torch.bfloat16, "int8")
    assert platform.resolve_weights("bfloat16", None, "cpu", True, "F16") == (torch.bfloat16, None)
    assert platform.resolve_weights("bfloat16", None, "cpu", True, None) == (torch.bfloat16, None)
    assert platform.resolve_weights("float32", None, "cpu", True, "Q4_1") == (torch.float32, None)
    assert platform.resolve_weights("auto", None, "cuda", True, "Q4_1") == (torch.bfloat16, None)
    assert platform.resolve_weights("bfloat16", None, "cpu", False, "Q4_1") == (torch.bfloat16, None)
    int4_kernel(False)
    assert platform.resolve_weights("bfloat16", None, "cpu", True, "Q4_1") == (torch.bfloat16, None)
    assert platform.resolve_weights("bfloat16", "int4", "cpu", True, "Q4_1") == (torch.bfloat16, "int4")


def test_a_q8_0_to_q5_gguf_runs_in_int8_where_the_cpu_kernel_runs(int8_kernel):
    int8_kernel(True)
    for stored in ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1"):
        assert platform.resolve_weights("bfloat16", None, "cpu", True, stored) == (torch.bfloat16, "int8")
    assert platform.resolve_weights("bfloat16", "none", "cpu", True, "Q8_0") == (torch.bfloat16, None)
    assert platform.resolve_weights("bfloat16", "int4", "cpu", True, "Q8_0") == (torch.bfloat16, "int4")
    assert platform.resolve_weights("float32", None, "cpu", True, "Q8_0") == (torch.float32, None)
    assert platform.resolve_weights("auto", None, "cuda", True, "Q8_0") == (torch.bfloat16, None)
    assert platform.resolve_weights("bfloat16", None, "cpu", False, "Q8_0") == (torch.bfloat16, None)
    int8_kernel(False)
    assert platform.resolve_weights("bfloat16", None, "cpu", True, "Q8_0") == (torch.bfloat16, None)


def test_a_declined_int4_leaves_the_dtype_the_weights_want(int4_kernel, monkeypatch):
    """bf16 only for int4's sake (its AVX2 kernel), then no int4 kernel: the dtype is asked
    again for unquantized weights."""
    int4_kernel(False)
    monkeypatch.setattr(platform, "cpu_bf16_reason",
                        lambda ops=True, quant=None: "bf16 kernels" if quant is None else None)
    assert platform.resolve_weights("auto", None, "cpu", True, "Q4_1") == (torch.bfloat16, None)
