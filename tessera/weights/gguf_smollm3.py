"""SmolLM3's config from a GGUF, read as llama.cpp writes and runs it (arch "smollm3"; its
converter is Llama's, so Q and K rows are permuted). transformers' GGUF conversion does not
know the architecture. The file holds Llama's keys; which layers skip rotary is not among
them: llama.cpp fixes every fourth layer as a NoPE layer (layer i when (i + 1) % 4 == 0),
which is SmolLM3's no_rope_layer_interval, so the config says that interval."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config

ARCH = "smollm3"
NO_ROPE_LAYER_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for SmolLM3


def smollm3_config(fields: dict, tensors: list) -> Any:
    """A SmolLM3Config for the file."""
    from transformers import SmolLM3Config

    return plain_decoder_config(SmolLM3Config, ARCH, fields, tensors, no_rope_layer_interval=NO_ROPE_LAYER_INTERVAL,
                                architectures=["SmolLM3ForCausalLM"])
