"""Device facts in one place: which dtype is fast here, how much memory is free."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import psutil
import torch

from tessera.config import async_scheduling_conflict

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (measured on the default model: decode
    1.7x faster than fp32 at batch 1, 1.8x the throughput at batch 32; docs/benchmarks.md)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


@functools.lru_cache(maxsize=None)
def cpu_bf16_reason(tessera_ops: bool = True, quantization: str | None = None) -> str | None:
    """Why bfloat16 is the faster dtype on this CPU, or None (float32 is).

    With native bf16 every path gains. Without it, torch's bf16 matmuls are emulated and
    slow (47 vs 186 GFLOP/s fp32 on the 2-core Xeon), but tessera's own AVX512 kernels
    widen bf16 to float32 in registers and stream half the bytes of float32 weights: the
    default model decodes in 11.8 ms per token there vs 44.0 in float32. So bf16 wins
    whenever the model runs on tessera's ops (`tessera_ops`, i.e. not the transformers
    fallback) and tessera's AVX512 or AVX2 kernels can run here."""
    if cpu_has_native_bf16():
        return "this CPU has native bf16 (avx512_bf16 or amx_bf16)"
    if not tessera_ops:
        return None
    from tessera.ops.cpu.build import unavailable_reason  # compiles the kernel on first use
    if unavailable_reason("gemm_bf16.c") is None:
        return "no native bf16, but tessera's AVX512 kernels run bf16 here, widened to float32 in registers"
    # AVX2-only CPUs: every decode kernel has an AVX2 build (the Xeon with AVX512 turned off
    # in tessera and torch: 21.7 vs 43.3 ms per token, 117 vs 115 tok/s at 32 prompts;
    # TTFT 395 vs 307 ms, prefill attention being torch's emulated bf16)
    # (int8 and int4 weights have AVX2 kernels of their own, gemm_int8_avx2.c, gemm_int4_avx2.c)
    needed = {"int8": "gemm_int8_avx2.c", "int4": "gemm_int4_avx2.c"}.get(quantization, "gemm_bf16_avx2.c")
    if unavailable_reason(needed) is None:
        return "no AVX512, but tessera's AVX2 kernels run bf16 here, widened to float32"
    return None


# the device "auto" means when set (cpu or cuda); the test suite pins it to cpu
DEVICE_ENV = "TESSERA_DEVICE"


def resolve_device(name: str, ranks: int = 1) -> str:
    """`name` with "auto" made concrete, as vLLM and TGI pick the accelerator without being
    told: CUDA when torch sees an NVIDIA GPU for each of this machine's `ranks`
    (tensor-parallel ranks it runs), all of compute capability 8.0 or later (bf16 and the
    Triton kernels), else the CPU; $TESSERA_DEVICE, when set, is what "auto" means."""
    if name != "auto":
        return name
    if os.environ.get(DEVICE_ENV):
        return os.environ[DEVICE_ENV]
    return "cuda" if _usable_gpus() >= ranks else "cpu"


def _usable_gpus() -> int:
    if not torch.cuda.is_available() or torch.version.hip is not None:  # ROCm: untested, so asked for only
        return 0
    count = torch.cuda.device_count()
    return count if all(torch.cuda.get_device_capability(i) >= (8, 0) for i in range(count)) else 0


def async_scheduling_default(device: str, speculative: bool, tensor_parallel_size: int) -> bool:
    """Whether async scheduling is on when not asked for: on CUDA, where host work overlaps
    the device's (+24% output tok/s on an H100, 1000 x 1000/1000, docs/benchmarks.md), unless
    speculation or several ranks rule it out; off on CPU, where there is nothing to overlap."""
    return device.startswith("cuda") and async_scheduling_conflict(speculative, tensor_parallel_size) is None


def resolve_dtype(name: str, device: str, tessera_ops: bool = True,
                  quantization: str | None = None) -> torch.dtype:
    """The dtype `name` means on `device`; `tessera_ops` says whether the model runs on
    tessera's op registry (native folders) or transformers' modules (the fallback),
    `quantization` the linear layers' weight format (--quantization)."""
    if name != "auto":
        return _DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_bf16_reason(tessera_ops, quantization) else torch.float32


# GGUF matrix formats tessera's int4 format holds as stored (tessera/weights/gguf_q4.py:
# Q4_0 and Q4_1 exactly, Q4_K with its group scales rounded to float16)
STORED_INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
# and those the CPU's int8 format (groups of 32 with a float16 step, as Q8_0) holds closely:
# Q8_0's codes come back from the bf16-loaded values (tessera/ops/linear_int8.py), 5- and
# 6-bit codes fit 8 bits with room to spare
STORED_INT8_FORMATS = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1")


def stored_quantization(stored_format: str | None) -> str | None:
    """The weight format that keeps a GGUF stored as `stored_format` compact: int4 for its
    4-bit formats, int8 for its 5- to 8-bit ones, else None."""
    return ("int4" if stored_format in STORED_INT4_FORMATS else
            "int8" if stored_format in STORED_INT8_FORMATS else None)


def _cpu_kernel_unavailable(quantization: str) -> list[str]:
    if quantization == "int4":
        from tessera.ops.cpu.linear_int4 import kernel_unavailable  # compiles the kernel on first use
    else:
        from tessera.ops.cpu.linear_int8 import kernel_unavailable
    return kernel_unavailable()


def resolve_weights(dtype: str, quantization: str | None, device: str, tessera_ops: bool = True,
                    stored_format: str | None = None) -> tuple[torch.dtype, str | None]:
    """(model dtype, the linear layers' weight format) for --dtype and --quantization on
    `device`; `stored_format`: how a GGUF stores its matrices (routers' stored_matrix_format).

    --quantization unset runs a GGUF as compact as its file where the CPU's kernel for that
    runs with bf16 activations, as llama.cpp runs such a file:
    - mostly Q4_0 / Q4_1 / Q4_K (the default model, llama.cpp's Q4_K_M files): int4, its
      4-bit matrices as stored (the dense matrices a K-quant mix keeps at 5-8 bits in int8).
      Decode streams 5 bits a weight instead of 16 (2x faster a token on the default model,
      docs/benchmarks.md);
    - mostly Q8_0 / Q6_K / Q5_K / Q5_0 / Q5_1: int8 in groups of 32 (8.5 bits a weight; the
      prompt perplexity of a Q8_0 default model is bf16's, docs/benchmarks.md).
    Elsewhere (CUDA, whose quantized kernels are not measured yet; float32) and for other
    sources the weights take the model dtype, as "none" asks."""
    requested = None if quantization == "none" else quantization
    kept = stored_quantization(stored_format) if quantization is None else None
    auto = kept is not None and tessera_ops and device.startswith("cpu")
    model_dtype = resolve_dtype(dtype, device, tessera_ops, kept if auto else requested)
    if auto and model_dtype == torch.bfloat16 and not _cpu_kernel_unavailable(kept):
        return model_dtype, kept
    if auto:  # declined: the dtype for the weights as they will be
        model_dtype = resolve_dtype(dtype, device, tessera_ops, requested)
    return model_dtype, requested


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(psutil.virtual_memory().available)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait for the device: on CUDA it
    goes through pinned memory, because a copy from pageable memory may synchronise with
    the stream (and async scheduling would lose its overlap). torch's pinned allocator keeps
    the block until the copy has run."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
