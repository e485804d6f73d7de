"""Rope scaling as llama.cpp's converter stores it in a GGUF, turned into the config fields
tessera's rotary reads (transformers' GGUF config conversion reads none of it, so a scaled
model would silently run unscaled):

- `{arch}.rope.scaling.type` "linear" or "yarn", with `.factor` and, for yarn,
  `.original_context_length` and the beta bounds;
- the `rope_freqs` tensor: Llama 3.1-3.3's "llama3" scaling, which the converter precomputes
  as one divisor per rotary frequency. It is kept as `config.rope_freq_factors` and divides
  the frequencies as llama.cpp's rope does (ops/rotary.py);
- the `rope_factors_long` / `rope_factors_short` tensors: Phi-3's longrope factors (with
  `rope.scaling.attn_factor`), back into the config's longrope parameters.
"""
from __future__ import annotations

from typing import Any

import numpy as np

ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS)  # read into the config, not model weights


def field_value(fields: dict, key: str) -> Any:
    """A metadata key's value in a gguf.GGUFReader's `fields`, or None when absent."""
    field = fields.get(key)
    return None if field is None else field.contents()


def rope_scaling_from_gguf(fields: dict, arch: str) -> dict | None:
    """The Hugging Face rope parameters (beyond rope_theta) the file's scaling keys describe,
    or None for unscaled rope."""
    kind = field_value(fields, f"{arch}.rope.scaling.type")
    factor = field_value(fields, f"{arch}.rope.scaling.factor")
    if kind is None:  # llama.cpp reads a factor without a type as linear
        legacy = field_value(fields, f"{arch}.rope.scale_linear")  # early GGUFs' own key
        factor = factor if factor is not None else legacy
        if factor in (None, 0.0, 1.0):
            return None
        kind = "linear"
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = field_value(fields, f"{arch}.rope.scaling.original_context_length")
        if factor is None or original is None:
            raise ValueError("GGUF yarn rope scaling needs rope.scaling.factor and "
                             "rope.scaling.original_context_length; this file lacks one")
        # llama.cpp's defaults, which are what transformers' yarn computes; other values have
        # no Hugging Face equivalent tessera could be sure of
        defaults = {"yarn_log_multiplier": 0.0, "yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0,
                    "attn_factor": 1.0}
        unmapped = {key: value for key, default in defaults.items()
                    if (value := field_value(fields, f"{arch}.rope.scaling.{key}")) not in (None, default)}
        if unmapped:
            raise ValueError(f"GGUF yarn rope scaling with {unmapped} is not supported; use the "
                             "Hugging Face folder of this model instead")
        params = {"rope_type": "yarn", "factor": float(factor),
                  "original_max_position_embeddings": int(original)}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = field_value(fields, f"{arch}.rope.scaling.{key}")
            if value is not None:
                params[name] = float(value)
        return params
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (linear and yarn are, and "
                     "Llama 3's rope_freqs); use the Hugging Face folder of this model instead")


def _factors(tensor: Any) -> list[float]:
    values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(values)) or not np.all(values > 0):
        raise ValueError(f"{tensor.name} holds values that are not positive finite numbers")
    return [float(x) for x in values]


def _longrope(fields: dict, arch: str, long: Any, short: Any) -> dict:
    if long is None or short is None:
        raise ValueError(f"a GGUF with only one of {' and '.join(LONGROPE_FACTORS)}: longrope needs both")
    params = {"rope_type": "longrope", "long_factor": _factors(long), "short_factor": _factors(short)}
    original = field_value(fields, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    attention = field_value(fields, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        params["attention_factor"] = float(attention)
    return params


def apply_gguf_rope(config: Any, fields: dict, tensors: list) -> None:
    """Set `config`'s rope scaling from the file's keys and its rope tensors (`tensors`: a
    gguf.GGUFReader's)."""
    arch = field_value(fields, "general.architecture")
    by_name = {t.name: t for t in tensors if t.name in ROPE_TENSORS}
    scaling = rope_scaling_from_gguf(fields, arch) if arch else None
    if any(name in by_name for name in LONGROPE_FACTORS):
        scaling = _longrope(fields, arch, *(by_name.get(name) for name in LONGROPE_FACTORS))
    if scaling:
        params = dict(getattr(config, "rope_parameters", None) or {})
        if "full_attention" in params:  # one set per layer type (Gemma 3): llama.cpp scales
            params["full_attention"] = {**params["full_attention"], **scaling}  # the global layers only
        else:
            params.update(scaling)
        config.rope_parameters = params
    if ROPE_FREQS in by_name:
        config.rope_freq_factors = _factors(by_name[ROPE_FREQS])
