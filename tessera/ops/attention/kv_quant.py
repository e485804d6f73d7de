"""The KV cache's storage type: the model dtype ("auto") or 8-bit floats (`--kv-cache-dtype
fp8`), which halve the cache of a bf16 model, so twice the tokens fit and decode reads half
the bytes per cached token.

As vLLM does without calibrated scales, values are stored unscaled: a write rounds to the
nearest fp8 value and saturates at the format's largest finite one (e4m3: +-448, 3
mantissa bits; e5m2: +-57344, 2 bits), so an outlier never becomes inf or NaN. Attention
widens what it reads back to float32. Every kernel reads this step's own K/V from the cache
too, so prefill sees the same rounded values decode will, and a prefix-cache hit gives
what recomputing the prefix gives.

The C and Triton kernels take the format as a code (FP8_FORMATS) and decode the bytes
themselves, so no fp8 hardware support is needed.
"""
from __future__ import annotations

import torch

from tessera.config import KV_CACHE_DTYPES

# --kv-cache-dtype names (vLLM's, and TGI's fp8_e4m3fn) -> storage; "auto": the model dtype
_STORAGE: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# the kernels' code for each stored format (0: the model dtype, stored as is)
FP8_FORMATS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
QUANTIZED_KV = tuple(FP8_FORMATS)


def kv_cache_torch_dtype(name: str) -> torch.dtype | None:
    """The storage dtype for a --kv-cache-dtype name (None: the model's own)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return _STORAGE.get(name)


def kv_format(cache: torch.Tensor) -> int:
    """The kernels' format code for a cache tensor (0 when it holds the model dtype)."""
    return FP8_FORMATS.get(cache.dtype, 0)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (nearest, ties to even), saturating at its largest finite value."""
    if x.dtype == dtype:
        return x
    if dtype not in FP8_FORMATS:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)
