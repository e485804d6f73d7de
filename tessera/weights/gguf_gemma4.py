"""Gemma 4's config from a GGUF, read as llama.cpp writes it (its converter's Gemma4Model).
transformers' own GGUF conversion cannot make one: the file gives the KV heads and the MLP
width per layer where they differ (the global layers' KV heads, double-wide shared layers)
and transformers' config takes one number for each, so tessera reads the file itself:

- the layer types from the sliding-window pattern (one flag per layer, true: sliding);
- key_length: the full layers' head size, key_length_swa the sliding ones';
- head_count_kv: one number, or per layer (the full layers' is the global KV head count);
- feed_forward_length: one number, or per layer (twice as wide from the first KV-shared
  layer on: use_double_wide_mlp);
- rope: freq_base for the full layers, freq_base_swa (10000 where absent) for the sliding
  ones; the full layers' proportional rope from the rope_freqs tensor (divisor 1 for each
  turned frequency pair, 1e30 for the rest);
- full layers without attn_v tensors: their values are their keys (attention_k_eq_v);
- shared_kv_layers, embedding_length_per_layer_input, the soft-cap and the experts' keys."""
from __future__ import annotations

from typing import Any

import numpy as np

from tessera.weights.gguf_rope import ROPE_FREQS, field_value

ARCH = "gemma4"


def _per_layer(value: Any, layers: int) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * layers
    if len(values) != layers:
        raise ValueError(f"gemma4 GGUF: {len(values)} per-layer values for {layers} layers")
    return values


def _turned_fraction(tensors: list, head_dim: int) -> float:
    """The share of the full layers' frequency pairs that turn (divisor 1 in rope_freqs)."""
    found = [t for t in tensors if t.name == ROPE_FREQS]
    if not found:
        return 1.0
    divisors = np.asarray(found[0].data, dtype=np.float32).reshape(-1)
    if divisors.size != head_dim // 2:
        raise ValueError(f"gemma4 GGUF: rope_freqs has {divisors.size} values for a {head_dim}-wide head")
    turned = int((divisors < 1e10).sum())
    if not np.all(divisors[:turned] == 1.0) or not np.all(divisors[turned:] >= 1e10):
        raise ValueError("gemma4 GGUF: rope_freqs is not a proportional rope (1s, then 1e30s)")
    return 2 * turned / head_dim


def gemma4_config(fields: dict, tensors: list) -> Any:
    """A Gemma4TextConfig for the file."""
    from transformers import Gemma4TextConfig

    def key(name: str, default: Any = None) -> Any:
        value = field_value(fields, f"{ARCH}.{name}")
        return default if value is None else value

    layers = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != layers:
        raise ValueError("gemma4 GGUF: attention.sliding_window_pattern must give each layer's type")
    types = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    kv_heads = _per_layer(key("attention.head_count_kv"), layers)
    widths = _per_layer(key("feed_forward_length"), layers)
    shared = int(key("attention.shared_kv_layers", 0))
    local_kv = {kv for kv, kind in zip(kv_heads, types) if kind == "sliding_attention"}
    global_kv = {kv for kv, kind in zip(kv_heads, types) if kind == "full_attention"}
    if len(local_kv) > 1 or len(global_kv) > 1:
        raise ValueError(f"gemma4 GGUF: KV heads differ within a layer type ({kv_heads})")
    first_shared = layers - shared
    double = widths[-1] == 2 * widths[0] and shared > 0
    if widths != [widths[0] * (2 if double and i >= first_shared else 1) for i in range(layers)]:
        raise ValueError(f"gemma4 GGUF: MLP widths {widths} are not one width (doubled on KV-shared layers)")
    names = {t.name for t in tensors}
    full_layers = [i for i, kind in enumerate(types) if kind == "full_attention" and i < first_shared]
    k_eq_v = bool(full_layers) and not any(f"blk.{i}.attn_v.weight" in names for i in full_layers)
    global_head = int(key("attention.key_length"))
    embed = next(t for t in tensors if t.name == "token_embd.weight")
    per_layer = next((t for t in tensors if t.name == "per_layer_token_embd.weight"), None)
    experts = int(key("expert_count", 0))
    if experts and (key("expert_used_count") is None or key("expert_feed_forward_length") is None):
        raise ValueError("gemma4 GGUF: expert_count without expert_used_count and expert_feed_forward_length")
    extra = dict(enable_moe_block=True, num_experts=experts, top_k_experts=int(key("expert_used_count")),
                 moe_intermediate_size=int(key("expert_feed_forward_length"))) if experts else {}
    if k_eq_v:  # (transformers' config gives the full layers their own KV heads only then)
        extra["num_global_key_value_heads"] = global_kv.pop()
    elif global_kv and global_kv != local_kv:
        raise ValueError(f"gemma4 GGUF: full layers with {global_kv} KV heads and values of their own")
    return Gemma4TextConfig(
        vocab_size=int(embed.shape[1]), hidden_size=int(key("embedding_length")), intermediate_size=widths[0],
        num_hidden_layers=layers, num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=local_kv.pop() if local_kv else kv_heads[0],
        head_dim=int(key("attention.key_length_swa", global_head)), global_head_dim=global_head,
        max_position_embeddings=int(key("context_length")), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        sliding_window=int(key("attention.sliding_window")), layer_types=types, num_kv_shared_layers=shared,
        use_double_wide_mlp=double, attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=int(key("embedding_length_per_layer_input", 0)),
        vocab_size_per_layer_input=int(per_layer.shape[1]) if per_layer is not None else int(embed.shape[1]),
        final_logit_softcapping=key("final_logit_softcapping"),
        tie_word_embeddings="output.weight" not in names,
        rope_parameters={"sliding_attention": {"rope_type": "default",
                                               "rope_theta": float(key("rope.freq_base_swa", 10000.0))},
                         "full_attention": {"rope_type": "proportional", "rope_theta": float(key("rope.freq_base")),
                                            "partial_rotary_factor": _turned_fraction(tensors, global_head)}},
        bos_token_id=field_value(fields, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(fields, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field_value(fields, "tokenizer.ggml.padding_token_id") or 0, **extra)
