"""Granite 4.0-H's config from a GGUF (arch "granitehybrid", as llama.cpp's converter writes it),
which transformers' conversion does not know, and its Mamba-2 tensors brought back.

- Layers: Mamba-2 where the per-layer `attention.head_count_kv` is 0, attention elsewhere;
  rotary only where `rope.scaling.finetuned` says so (the Granite 4.0-H releases have none);
  Granite's multipliers under its names (gguf_granite.py's defaults); experts (with a shared
  MLP) when the file has `expert_count`, else the shared MLP alone.
- Mamba-2: inner width, heads (`ssm.time_step_rank`), groups, state size and conv kernel from
  `ssm.*`; the converter stored -exp(A_log) [heads, 1] (ssm_a), D as [heads, 1] and the gated
  norm as [groups, inner / groups]; Q / K rows permuted as Llama's."""
from __future__ import annotations

from typing import Any

import torch

from tessera.weights.gguf_granite import granite_multipliers
from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys
from tessera.weights.gguf_rope import field_value
from tessera.weights.lazy import materialize

ARCH = "granitehybrid"


def granitehybrid_config(fields: dict, tensors: list) -> Any:
    from transformers import GraniteMoeHybridConfig

    key = required_keys(fields, ARCH)
    kv_heads = key("attention.head_count_kv")
    if not isinstance(kv_heads, (list, tuple)):
        raise ValueError(f"{ARCH} GGUF: attention.head_count_kv is not per layer; the file cannot say which "
                         "layers are Mamba-2")
    hidden, inner, heads = int(key("embedding_length")), int(key("ssm.inner_size")), int(key("ssm.time_step_rank"))
    names = {t.name for t in tensors}
    experts = int(key("expert_count", 0))
    head_dim = hidden // int(key("attention.head_count"))
    if int(key("rope.dimension_count", head_dim)) != head_dim:  # (Bamba's files: partial rotary)
        raise ValueError(f"a {ARCH} GGUF with rotary over part of each head (Bamba's) is not read yet; serve "
                         "the model's Hugging Face folder")
    return plain_decoder_config(
        GraniteMoeHybridConfig, ARCH, fields, tensors, architectures=["GraniteMoeHybridForCausalLM"],
        layer_types=["full_attention" if n else "linear_attention" for n in kv_heads],
        position_embedding_type="rope" if field_value(fields, f"{ARCH}.rope.scaling.finetuned") else None,
        mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_expand=_whole(inner, hidden),
        mamba_n_groups=int(key("ssm.group_count")), mamba_d_state=int(key("ssm.state_size")),
        mamba_d_conv=int(key("ssm.conv_kernel")), mamba_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in names),
        mamba_proj_bias=any(n.endswith("ssm_in.bias") for n in names),
        num_local_experts=experts, num_experts_per_tok=int(key("expert_used_count", 0)),
        intermediate_size=int(key("expert_feed_forward_length", 0)) or int(key("feed_forward_length")),
        shared_intermediate_size=int(key("expert_shared_feed_forward_length", 0)) or int(key("feed_forward_length")),
        **granite_multipliers(key, logit_scale=1.0))


def _whole(inner: int, hidden: int) -> int:
    if inner % hidden:
        raise ValueError(f"{ARCH} GGUF: Mamba-2's inner width {inner} is not a whole multiple of {hidden}")
    return inner // hidden


def mamba2_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Mamba-2 tensor as the Hugging Face checkpoint holds it (module docstring), by its
    Hugging Face name (the mixer `mamba` in Granite's, `mixer` in Nemotron-H's)."""
    if name.endswith((".mamba.A_log", ".mixer.A_log")):
        return torch.log(-materialize(tensor)).reshape(-1)
    if name.endswith((".mamba.D", ".mamba.norm.weight", ".mixer.D", ".mixer.norm.weight")):
        return materialize(tensor).reshape(-1)
    return tensor
