"""Mistral Small 3.1 / 3.2's language model from a GGUF of arch "mistral3", as llama.cpp's
newer converter writes it (older files are arch "llama", which transformers reads): Llama's
keys, Q and K rows permuted. transformers' GGUF conversion does not know the architecture.
The converter writes rope scaling and an attention temperature for Ministral 3 only, which
is not read here yet: such a file is refused rather than run without them."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config

ARCH = "mistral3"


def mistral3_config(fields: dict, tensors: list) -> Any:
    """A MistralConfig for the file (head_dim and rope completed after, as for every file)."""
    from transformers import MistralConfig

    scaled = [key for key in fields if key.startswith(f"{ARCH}.rope.scaling.")
              or (key.startswith(f"{ARCH}.") and "temperature" in key)]
    if scaled:
        raise ValueError(f"{ARCH} GGUF with {scaled[0]} (Ministral 3's rope scaling and attention temperature) "
                         "is not read yet; its Hugging Face folder is")
    return plain_decoder_config(MistralConfig, ARCH, fields, tensors, architectures=["MistralForCausalLM"],
                                sliding_window=None)
