"""Qwen2-VL and Qwen2.5-VL's language model: Qwen2's layers with multimodal rotary
positions (M-RoPE, ops/rotary.py: MRotaryEmbedding), as transformers' Qwen2_5_VLTextModel."""
from __future__ import annotations

from transformers import PretrainedConfig

from tessera.models.llama.modeling import head_dim_of
from tessera.models.qwen2.modeling import Qwen2ForCausalLM, Qwen2Model
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import MRotaryEmbedding, rope_parameters


def mrope_parameters(config: PretrainedConfig) -> tuple[dict, list[int]]:
    """(rope parameters, mrope_section) from a transformers 5 config (rope_parameters with
    mrope_section) or a 4-style one (rope_scaling {"type": "mrope", "mrope_section"})."""
    params = rope_parameters(config)
    section = params.pop("mrope_section", None)
    if section is None:
        raise ValueError(f"{config.model_type}: the config has no mrope_section")
    if params["rope_type"] == "mrope":  # transformers 4's name for the default frequencies
        params["rope_type"] = "default"
    return params, list(section)


class Qwen2VLTextModel(Qwen2Model):
    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> MRotaryEmbedding:
        params, section = mrope_parameters(config)
        return MRotaryEmbedding(head_dim_of(config), config.max_position_embeddings, params, target, section)


class Qwen2VLForCausalLM(Qwen2ForCausalLM):
    model_cls = Qwen2VLTextModel
