"""DeepSeek-V2 / V2-Lite / V3 / R1, Kimi K2 and GLM-4.7-Flash from a GGUF (arch "deepseek2",
as llama.cpp's converter writes it), which transformers' GGUF conversion does not know.

- Multi-head latent attention: `kv_lora_rank`, `q_lora_rank` (absent: a plain attn_q),
  `rope.dimension_count` (qk_rope_head_dim). Files from mid-2025 on store the attention as
  MQA over the latent (head_count_kv 1, key_length kv_lora_rank + rope) and put the per-head
  sizes in `key_length_mla` / `value_length_mla`, with kv_b_proj split into attn_k_b (its
  key half, transposed) and attn_v_b; older ones have the per-head sizes in key_length /
  value_length and one attn_kv_b. Both load (models/deepseek/mla.py joins the halves).
- Experts: `expert_gating_func` sigmoid is V3's routing (V3, R1, Kimi K2, GLM-4.7-Flash:
  a deepseek_v3 config), softmax V2's (a deepseek_v2 config, group-limited when the file has
  more than one expert group); counts, widths, the dense leading blocks, the weights' scale
  and renormalisation from their keys.
- YaRN: llama.cpp stores DeepSeek's mscale_all_dim as `rope.scaling.yarn_log_multiplier`
  = 0.1 x mscale_all_dim (the released configs have mscale = mscale_all_dim), which scales
  the softmax, not the rotary (mla.mla_scale).
Rotary is interleaved (llama.cpp's "norm" rope on unpermuted rows, as DeepSeek's own)."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys
from tessera.weights.gguf_rope import field_value

ARCH = "deepseek2"
SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType)


def _rope_parameters(fields: dict, theta: float) -> dict:
    def key(name: str) -> Any:
        return field_value(fields, f"{ARCH}.rope.scaling.{name}")

    kind = key("type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn" or key("factor") is None or key("original_context_length") is None:
        raise ValueError(f"{ARCH} GGUF: rope scaling {kind!r} without yarn's factor and original context "
                         "length is not supported; use the Hugging Face folder of this model instead")
    params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(key("factor")),
              "original_max_position_embeddings": int(key("original_context_length"))}
    for name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if key(name) is not None:
            params[hf_name] = float(key(name))
    if key("yarn_log_multiplier"):
        # (stored as float32: rounded back to the config's few decimals, 0.707 or 1.0)
        params["mscale"] = params["mscale_all_dim"] = round(float(key("yarn_log_multiplier")) / 0.1, 6)
    return params


def deepseek2_config(fields: dict, tensors: list) -> Any:
    """A DeepseekV3Config (sigmoid routing) or DeepseekV2Config (softmax) for the file."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    key = required_keys(fields, ARCH)

    names = {t.name for t in tensors}
    rope = int(key("rope.dimension_count"))
    if field_value(fields, f"{ARCH}.attention.key_length_mla") is not None:
        qk_head, v_head = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    else:  # before the split of kv_b: the per-head sizes are the plain ones
        qk_head, v_head = int(key("attention.key_length")), int(key("attention.value_length"))
    gating = int(key("expert_gating_func", SOFTMAX))
    if gating not in (SOFTMAX, SIGMOID):
        raise ValueError(f"{ARCH} GGUF: expert gating function {gating} is not supported (softmax, sigmoid are)")
    v3 = gating == SIGMOID
    groups, used_groups = int(key("expert_group_count", 1)), int(key("expert_group_used_count", 1))
    routing = dict(n_group=groups, topk_group=used_groups,
                   routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(key("expert_weights_norm", False)))
    if not v3:
        routing["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    heads = int(key("attention.head_count"))
    config = plain_decoder_config(
        DeepseekV3Config if v3 else DeepseekV2Config, ARCH, fields, tensors,
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        num_key_value_heads=heads,  # (the file's 1 is the latent cache's MQA, which MLA is here)
        q_lora_rank=int(key("attention.q_lora_rank")) if "blk.0.attn_q_a.weight" in names else None,
        kv_lora_rank=int(key("attention.kv_lora_rank")), qk_rope_head_dim=rope, qk_nope_head_dim=qk_head - rope,
        v_head_dim=v_head, head_dim=rope, rope_interleave=True,
        n_routed_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        n_shared_experts=int(key("expert_shared_count", 0)),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        first_k_dense_replace=int(key("leading_dense_block_count", 0)), attention_bias=False, **routing)
    config.rope_parameters = _rope_parameters(fields, float(key("rope.freq_base", 10000.0)))
    return config
