"""Nemotron-H's config from a GGUF (arch "nemotron_h": Nemotron-H, Nemotron Nano 9B / 12B v2;
"nemotron_h_moe": Nemotron 3 Nano), as llama.cpp's converter writes it, which transformers'
conversion does not know.

- Blocks: attention where the per-layer `attention.head_count_kv` is not 0, a feed-forward
  block where the per-layer `feed_forward_length` is not 0 (an MLP, or in a _moe file the
  mixture of experts), Mamba-2 elsewhere. Every block's norm is `attn_norm`.
- Mamba-2 as Granite 4.0-H's files keep it (gguf_granitehybrid.py: -exp(A_log), D and the
  gated norm reshaped, `ssm.*` sizes); Q / K rows permuted as Llama's (the attention has
  no rotary, so the permutation leaves scores alone, but the rows are put back).
- Experts: gateless (up, down), DeepSeek-V3's router (sigmoid, the `exp_probs_b` choice bias,
  `expert_group_count` groups, renormalised by `expert_weights_norm`, scaled by
  `expert_weights_scale`), a shared expert, and the latent width (`moe_latent_size`).
- The time-step floor (time_step_min) is not in the file: the released configs' 0.001,
  transformers' default, stays."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys
from tessera.weights.gguf_rope import field_value

ARCHES = ("nemotron_h", "nemotron_h_moe")


def nemotron_h_config(fields: dict, tensors: list) -> Any:
    from transformers import NemotronHConfig

    arch = field_value(fields, "general.architecture")
    key = required_keys(fields, arch)
    kv_heads, feed_forward = key("attention.head_count_kv"), key("feed_forward_length")
    if not isinstance(kv_heads, (list, tuple)) or not isinstance(feed_forward, (list, tuple)):
        raise ValueError(f"{arch} GGUF: attention.head_count_kv and feed_forward_length are not per layer; the "
                         "file cannot say which blocks are Mamba-2, attention or feed-forward")
    moe = arch == "nemotron_h_moe"
    blocks = ["full_attention" if kv else ("moe" if moe else "mlp") if ff else "linear_attention"
              for kv, ff in zip(kv_heads, feed_forward)]
    names = {t.name for t in tensors}
    inner, heads = int(key("ssm.inner_size")), int(key("ssm.time_step_rank"))
    extra: dict[str, Any] = {}
    if moe:
        groups = int(key("expert_group_count", 1))
        used_groups = field_value(fields, f"{arch}.expert_group_used_count")
        if groups > 1 and used_groups is None:
            raise ValueError(f"{arch} GGUF: {groups} expert groups, but the file does not say how many a token "
                             f"uses ({arch}.expert_group_used_count)")
        latent = field_value(fields, f"{arch}.moe_latent_size")
        extra = dict(n_routed_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                     moe_intermediate_size=int(key("expert_feed_forward_length")),
                     moe_shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")),
                     n_shared_experts=int(key("expert_shared_count", 1)),
                     norm_topk_prob=bool(key("expert_weights_norm", False)),
                     routed_scaling_factor=float(key("expert_weights_scale", 1.0)), n_group=groups,
                     topk_group=int(used_groups or 1), moe_latent_size=None if latent is None else int(latent))
    return plain_decoder_config(
        NemotronHConfig, arch, fields, tensors, architectures=["NemotronHForCausalLM"], layers_block_type=blocks,
        head_dim=int(key("attention.key_length")), layer_norm_epsilon=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        mamba_num_heads=heads, mamba_head_dim=inner // heads, n_groups=int(key("ssm.group_count")),
        ssm_state_size=int(key("ssm.state_size")), conv_kernel=int(key("ssm.conv_kernel")),
        use_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in names),
        use_bias=any(n.endswith("ssm_in.bias") for n in names), **extra)
