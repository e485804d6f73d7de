"""LFM2's config from a GGUF (arch "lfm2", as llama.cpp's converter writes it): which layers
attend and which convolve is the per-layer `attention.head_count_kv` (0 for a convolution
layer), the convolution's width `shortconv.l_cache`, and the feed-forward width the file
gives is already the one transformers' block_auto_adjust_ff_dim rule computes (so the rule
is off here). Read by tessera: transformers' conversion takes the per-layer head counts as
one number."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config
from tessera.weights.gguf_rope import field_value

ARCH = "lfm2"


def lfm2_config(fields: dict, tensors: list) -> Any:
    from transformers import Lfm2Config

    kv_heads = field_value(fields, f"{ARCH}.attention.head_count_kv")
    width = field_value(fields, f"{ARCH}.shortconv.l_cache")
    if not isinstance(kv_heads, (list, tuple)) or width is None:
        raise ValueError(f"{ARCH} GGUF: the file lacks per-layer {ARCH}.attention.head_count_kv or "
                         f"{ARCH}.shortconv.l_cache")
    names = {t.name for t in tensors}
    return plain_decoder_config(
        Lfm2Config, ARCH, fields, tensors, architectures=["Lfm2ForCausalLM"],
        layer_types=["full_attention" if heads else "conv" for heads in kv_heads],
        conv_L_cache=int(width), conv_bias=any(n.endswith("shortconv.in_proj.bias") for n in names),
        block_auto_adjust_ff_dim=False, norm_eps=float(field_value(fields, f"{ARCH}.attention.layer_norm_rms_epsilon")
                                                        or 1e-5))
