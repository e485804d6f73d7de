"""Rope scaling as llama.cpp's converter stores it in a GGUF, turned into the config fields
tessera's rotary reads (transformers' GGUF config conversion reads none of it, so a scaled
model would silently run unscaled):

- `{arch}.rope.scaling.type` "linear" or "yarn", with `.factor` and, for yarn,
  `.original_context_length` and the beta bounds;
- the `rope_freqs` tensor: Llama 3.1-3.3's "llama3" scaling, which the converter precomputes
  as one divisor per rotary frequency. It is kept as `config.rope_freq_factors` and divides
  the frequencies as llama.cpp's rope does (ops/rotary.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np

ROPE_FREQS = "rope_freqs.weight"


def _field(fields: dict, key: str) -> Any:
    field = fields.get(key)
    return None if field is None else field.contents()


def rope_scaling_from_gguf(fields: dict, arch: str) -> dict | None:
    """The Hugging Face rope parameters (beyond rope_theta) the file's scaling keys describe,
    or None for unscaled rope."""
    kind = _field(fields, f"{arch}.rope.scaling.type")
    factor = _field(fields, f"{arch}.rope.scaling.factor")
    if kind is None:  # early GGUFs: only a linear scale, under its own key
        legacy = _field(fields, f"{arch}.rope.scale_linear")
        if legacy in (None, 1.0):
            return None
        kind, factor = "linear", legacy
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = _field(fields, f"{arch}.rope.scaling.original_context_length")
        if factor is None or original is None:
            raise ValueError("GGUF yarn rope scaling needs rope.scaling.factor and "
                             "rope.scaling.original_context_length; this file lacks one")
        unmapped = {key: value for key in ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor",
                                           "attn_factor")
                    if (value := _field(fields, f"{arch}.rope.scaling.{key}")) not in (None, 0.0, 1.0)}
        if unmapped:
            raise ValueError(f"GGUF yarn rope scaling with {unmapped} is not supported; use the "
                             "Hugging Face folder of this model instead")
        params = {"rope_type": "yarn", "factor": float(factor),
                  "original_max_position_embeddings": int(original)}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(fields, f"{arch}.rope.scaling.{key}")
            if value is not None:
                params[name] = float(value)
        return params
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (linear and yarn are, and "
                     "Llama 3's rope_freqs); use the Hugging Face folder of this model instead")


def apply_gguf_rope(config: Any, fields: dict, tensors: list) -> None:
    """Set `config`'s rope scaling from the file's keys and its rope_freqs tensor (`tensors`:
    a gguf.GGUFReader's)."""
    arch = _field(fields, "general.architecture")
    scaling = rope_scaling_from_gguf(fields, arch) if arch else None
    if scaling:
        params = dict(getattr(config, "rope_parameters", None) or {})
        params.update(scaling)
        config.rope_parameters = params
    freqs = next((t for t in tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return
    factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(factors)) or not np.all(factors > 0):
        raise ValueError(f"{ROPE_FREQS} holds values that are not positive finite numbers")
    config.rope_freq_factors = [float(x) for x in factors]
