"""OLMo 2's config from a GGUF (arch "olmo2", as llama.cpp's converter writes it: Q / K not
permuted, the norms after attention and MLP as post_attention_norm / post_ffw_norm, the
whole-projection q / k norms). transformers' conversion does not know the arch. OLMo 3's
files (the same arch with a sliding window) are refused by name: their windowed layers and
YaRN keys are not read yet."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config
from tessera.weights.gguf_rope import field_value

ARCH = "olmo2"


def olmo2_config(fields: dict, tensors: list) -> Any:
    from transformers import Olmo2Config

    if field_value(fields, f"{ARCH}.attention.sliding_window") is not None:
        raise ValueError("an OLMo 3 GGUF (arch olmo2 with a sliding window) is not read yet; serve its Hugging "
                         "Face folder")
    return plain_decoder_config(Olmo2Config, ARCH, fields, tensors, architectures=["Olmo2ForCausalLM"])
