"""Qwen3-VL's language model: Qwen3's layers (or Qwen3-MoE's, for Qwen3-VL-MoE) with
interleaved multimodal rotary positions (the t, h, w frequencies in turn; ops/rotary.py)
and DeepStack: the features of earlier vision layers are added to the image tokens'
hidden states after the first layers, one level after each (transformers'
Qwen3VLTextModel._deepstack_process)."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.llama.modeling import head_dim_of
from tessera.models.qwen2_vl.modeling import mrope_parameters
from tessera.models.qwen3.modeling import Qwen3ForCausalLM, Qwen3Model
from tessera.models.qwen3_moe.modeling import Qwen3MoeForCausalLM, Qwen3MoeModel
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import MRotaryEmbedding


def interleaved_mrope(config: PretrainedConfig, target: OpTarget, rotary_dim: int | None = None) -> MRotaryEmbedding:
    """`rotary_dim`: the dimensions turned, when not the whole head (Qwen3.5's quarter)."""
    params, section = mrope_parameters(config)
    interleaved = bool(params.pop("mrope_interleaved", True))  # every Qwen3-VL interleaves
    return MRotaryEmbedding(rotary_dim or head_dim_of(config), config.max_position_embeddings, params, target,
                            section, interleaved=interleaved)


class DeepStackForward:
    """The forward of a Qwen3-VL language model (mixed in before its layer stack's class)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                mrope_rows: torch.Tensor | None = None, mrope_positions: torch.Tensor | None = None,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """`deepstack`: [image rows, levels, hidden], added to the rows `mrope_rows` after
        layers 0 .. levels - 1."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb(positions, mrope_rows, mrope_positions)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual)
            if deepstack is not None and i < deepstack.shape[1]:
                # the layer's output is hidden + residual (added by the next norm): either takes it
                hidden = hidden.index_add(0, mrope_rows, deepstack[:, i].to(hidden.dtype))
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3VLTextModel(DeepStackForward, Qwen3Model):
    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> MRotaryEmbedding:
        return interleaved_mrope(config, target)


class Qwen3VLForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3VLTextModel


class Qwen3VLMoeTextModel(DeepStackForward, Qwen3MoeModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        if getattr(config, "norm_topk_prob", None) is None:
            config.norm_topk_prob = True  # Qwen3-VL-MoE's router always renormalises its top k
        super().__init__(config, target)

    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> MRotaryEmbedding:
        return interleaved_mrope(config, target)


class Qwen3VLMoeForCausalLM(Qwen3MoeForCausalLM):
    model_cls = Qwen3VLMoeTextModel
