"""SmolLM3's config from a GGUF, read as llama.cpp writes and runs it (arch "smollm3"; its
converter is Llama's, so Q and K rows are permuted). transformers' GGUF conversion does not
know the architecture. The file holds Llama's keys; which layers skip rotary is not among
them: llama.cpp fixes every fourth layer as a NoPE layer (layer i when (i + 1) % 4 == 0),
which is SmolLM3's no_rope_layer_interval, so the config says that interval."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_rope import field_value

ARCH = "smollm3"
NO_ROPE_LAYER_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for SmolLM3


def smollm3_config(fields: dict, tensors: list) -> Any:
    """A SmolLM3Config for the file (rope scaling, head_dim and biases are completed after,
    as for every file: gguf_config.complete_gguf_config)."""
    from transformers import SmolLM3Config

    def key(name: str, default: Any = None) -> Any:
        value = field_value(fields, f"{ARCH}.{name}")
        return default if value is None else value

    vocab = key("vocab_size") or len(field_value(fields, "tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ValueError("smollm3 GGUF: the file gives no vocabulary size")
    names = {t.name for t in tensors}

    def token(name: str) -> int | None:
        value = field_value(fields, f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    return SmolLM3Config(
        vocab_size=int(vocab), hidden_size=int(key("embedding_length")), intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")), num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv", key("attention.head_count"))),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        no_rope_layer_interval=NO_ROPE_LAYER_INTERVAL, tie_word_embeddings="output.weight" not in names,
        bos_token_id=token("bos"), eos_token_id=token("eos"), pad_token_id=token("padding"),
        architectures=["SmolLM3ForCausalLM"])
