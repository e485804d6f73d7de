"""Qwen3.5's language models from a GGUF (arch "qwen35", or "qwen35moe" with experts, as
llama.cpp's converter writes them; Qwen3-Next's "qwen3next" too), which transformers' GGUF
conversion does not know: the config, and each tensor
brought back from the form the converter stored it in.

The converter changes the Gated DeltaNet layers' tensors for its kernels:
- (Qwen3.5 only) where a key head serves several value heads, the value heads go from grouped by key head
  (k0: v0 v1, k1: v0 v1) to tiled (v0 of every key head, then v1 of every key head), in the
  value rows of in_proj_qkv, in in_proj_z, in_proj_a / _b, A_log, dt_bias, the value
  channels of conv1d, and the input columns of out_proj;
- A_log is stored as -exp(A_log) (ssm_a), dt_bias as ssm_dt.bias, conv1d squeezed to [C, K];
- (Qwen3-Next) its in_proj_qkvz, each key head's q, k, v and z together, is stored as Qwen3.5
  keeps it: all queries, keys and values (attn_qkv), then all z (attn_gate); in_proj_ba as is;
- every (1 + w) RMSNorm is stored with the 1 added, but the gated norm (ssm_norm), which is
  a plain one (the routers' gguf_norm_offset / gguf_plain_norms take it off).
Layers are linear attention but every `full_attention_interval`-th, which attends; the
multi-token-prediction blocks (`nextn_predict_layers`) counted into block_count are not served.
Qwen3.5's interleaved M-RoPE sections (`rope.dimension_sections`, which the converter always
writes) stay in the config (`mrope_section`), as gguf_qwen_vl.py keeps Qwen3-VL's: alone a
file is its text model (M-RoPE over text is plain rotary), and with a projector file
(--mmproj: gguf_mmproj_qwen.py) the image-text model is rebuilt."""
from __future__ import annotations

from typing import Any

import torch

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys
from tessera.weights.gguf_qwen_vl import MROPE_SECTION, mrope_sections
from tessera.weights.gguf_rope import field_value
from tessera.weights.lazy import materialize

ARCHES = ("qwen35", "qwen35moe", "qwen3next")  # Qwen3.5's dense models, its mixtures of experts, Qwen3-Next


def qwen35_config(fields: dict, tensors: list) -> Any:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    arch = field_value(fields, "general.architecture")
    key = required_keys(fields, arch)

    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    interval = int(key("full_attention_interval", 4))
    head_dim = int(key("attention.key_length"))
    num_v, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    rotary = int(key("rope.dimension_count", head_dim // 4))
    experts = {}
    if arch != "qwen35":  # (Qwen3.5-MoE renormalises the routed top-k always, Qwen3-Next's releases too)
        names = {t.name for t in tensors}
        experts = dict(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                       moe_intermediate_size=int(key("expert_feed_forward_length")),
                       shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")))
        if arch == "qwen3next":  # its dense layers: those without experts
            experts |= dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[
                i for i in range(layers)
                if f"blk.{i}.ffn_gate_exps.weight" not in names and f"blk.{i}.ffn_gate_up_exps.weight" not in names])
    sections = mrope_sections(fields, arch) if arch != "qwen3next" else []  # (Qwen3-Next has no images)
    images = {MROPE_SECTION: sections} if sections else {}
    config_cls, architecture = {"qwen35": (Qwen3_5TextConfig, "Qwen3_5ForCausalLM"),
                                "qwen35moe": (Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM"),
                                "qwen3next": (Qwen3NextConfig, "Qwen3NextForCausalLM")}[arch]
    config = plain_decoder_config(
        config_cls, arch, fields, tensors, architectures=[architecture], num_hidden_layers=layers,
        head_dim=head_dim, layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                        for i in range(layers)],
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")), linear_key_head_dim=int(key("ssm.state_size")),
        linear_num_key_heads=int(key("ssm.group_count")), linear_num_value_heads=num_v,
        linear_value_head_dim=inner // num_v, **experts, **images)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotary / head_dim}
    return config


def _grouped(tensor: torch.Tensor, dim: int, num_k: int, per_k: int, head: int) -> torch.Tensor:
    """Value heads tiled (per_k groups of num_k) along `dim` back to grouped by key head."""
    shape = list(tensor.shape)
    split = shape[:dim] + [per_k, num_k, head] + shape[dim + 1:]
    return tensor.reshape(split).transpose(dim, dim + 1).reshape(shape)


def qwen35_tensor(config: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as the Hugging Face checkpoint holds it (module docstring), by its name; a
    matrix the file keeps wider than int4 stays marked so (weights/gguf.py, stored_wider)."""
    if ".linear_attn." not in name:
        return tensor
    out = _as_checkpoint(config, name, tensor)
    if getattr(tensor, "stored_wider", False):
        out.stored_wider = True
    return out


def _as_checkpoint(config: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    tensor = materialize(tensor)
    if name.endswith(".A_log"):
        tensor = torch.log(-tensor)
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    if num_k == num_v or config.model_type == "qwen3_next":  # (Qwen3-Next's files keep the grouping)
        return tensor
    per_k, dk, dv = num_v // num_k, config.linear_key_head_dim, config.linear_value_head_dim
    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        qk = 2 * num_k * dk  # the query and key rows (channels) stay
        return torch.cat((tensor[:qk], _grouped(tensor[qk:], 0, num_k, per_k, dv)))
    if name.endswith("in_proj_z.weight"):
        return _grouped(tensor, 0, num_k, per_k, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
        return _grouped(tensor, 0, num_k, per_k, 1)
    if name.endswith("out_proj.weight"):
        return _grouped(tensor, 1, num_k, per_k, dv)
    return tensor
