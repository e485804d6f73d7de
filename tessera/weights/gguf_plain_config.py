"""The config of a decoder GGUF whose architecture transformers' conversion does not know,
read from the keys every llama.cpp decoder file has (`{arch}.block_count`, `.embedding_length`,
...), for the types built on them (gguf_smollm3.py, gguf_qwen_vl.py)."""
from __future__ import annotations

from typing import Any, Callable

from tessera.weights.gguf_rope import field_value


def required_keys(fields: dict, arch: str) -> Callable[..., Any]:
    """`key(name, default=None)`: the file's `{arch}.{name}`, else `default`; a missing key
    without a default is an error naming it."""
    def key(name: str, default: Any = None) -> Any:
        value = field_value(fields, f"{arch}.{name}")
        if value is None and default is None:
            raise ValueError(f"{arch} GGUF: the file lacks {arch}.{name}")
        return default if value is None else value

    return key


def plain_decoder_config(config_cls: type, arch: str, fields: dict, tensors: list, **extra: Any) -> Any:
    """`config_cls` from the file's shared decoder keys; `extra` adds or overrides fields
    (rope scaling, head_dim and biases are completed after, as for every file:
    gguf_config.complete_gguf_config)."""
    def key(name: str, default: Any = None) -> Any:
        value = field_value(fields, f"{arch}.{name}")
        return default if value is None else value

    vocab = key("vocab_size") or len(field_value(fields, "tokenizer.ggml.tokens") or [])
    if not vocab:
        raise ValueError(f"{arch} GGUF: the file gives no vocabulary size")
    required = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
    missing = [f"{arch}.{name}" for name in required if key(name) is None]
    if missing:
        raise ValueError(f"{arch} GGUF: the file lacks {', '.join(missing)}")
    names = {t.name for t in tensors}

    def token(name: str) -> int | None:
        value = field_value(fields, f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    heads = int(key("attention.head_count"))
    kv_heads, feed_forward = key("attention.head_count_kv", heads), key("feed_forward_length")
    # per layer: 0 where a layer has no attention (LFM2's), or no feed-forward (Nemotron-H's)
    kv_heads, feed_forward = (max(v) if isinstance(v, (list, tuple)) else v for v in (kv_heads, feed_forward))
    values = dict(
        vocab_size=int(vocab), hidden_size=int(key("embedding_length")),
        intermediate_size=int(feed_forward),
        num_hidden_layers=int(key("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=token("bos"), eos_token_id=token("eos"), pad_token_id=token("padding"))
    return config_cls(**{**values, **extra})
