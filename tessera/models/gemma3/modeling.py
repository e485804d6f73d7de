"""Gemma 3 (text), following transformers' modeling_gemma3 (Gemma3ForCausalLM): Gemma 2's
layer (four (1 + w) RMSNorms, sqrt(hidden)-scaled embeddings, gelu_pytorch_tanh MLP,
query_pre_attn_scalar scaling, a sliding window on the layers layer_types marks, an optional
final-logit soft-cap) plus
- a (1 + w) RMSNorm over head_dim on every query and key head, before rotary;
- one rotary table per layer type: sliding layers use rope_parameters["sliding_attention"]
  (theta 10k), full layers rope_parameters["full_attention"] (theta 1M, linear-scaled in
  the larger models). transformers 4-style configs (rope_theta, rope_scaling and
  rope_local_base_freq) are read too.
The config's attn_logit_softcapping is ignored, as transformers' Gemma 3 ignores it (released
checkpoints set none).

Gemma 3 4B-27B ship as multimodal checkpoints (model_type "gemma3": a SigLIP vision tower, a
projector and the language model under `language_model.`); tessera serves their language
model, text in and text out: the router reads text_config and the vision weights are skipped."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import PretrainedConfig

from tessera.models.gemma2.modeling import (Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM,
                                            Gemma2Model, Gemma2RMSNorm)
from tessera.models.llama.modeling import Rope, head_dim_of
from tessera.models.qwen3.modeling import HeadNormForward
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding, rope_parameters

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_rope_parameters(config: PretrainedConfig) -> dict[str, dict]:
    """{layer type: rope parameters as ops/rotary reads them}."""
    params = getattr(config, "rope_parameters", None) or {}
    if all(kind in params for kind in LAYER_TYPES):  # transformers 5: one dict per layer type
        return {kind: rope_parameters(SimpleNamespace(
            rope_parameters=params[kind], max_position_embeddings=config.max_position_embeddings))
            for kind in LAYER_TYPES}
    local = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return {"sliding_attention": rope_parameters(SimpleNamespace(
                rope_parameters=local, max_position_embeddings=config.max_position_embeddings)),
            "full_attention": rope_parameters(config)}


class Gemma3Attention(HeadNormForward, Gemma2Attention):
    def __init__(self, config: PretrainedConfig, layer_idx: int, target: OpTarget):
        super().__init__(config, layer_idx, target)
        self.q_norm = Gemma2RMSNorm(self.head_dim, config.rms_norm_eps, target)
        self.k_norm = Gemma2RMSNorm(self.head_dim, config.rms_norm_eps, target)

    def attention_options(self, config: PretrainedConfig) -> dict:
        return {**super().attention_options(config), "softcap": None}


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer

    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> None:
        params = layer_rope_parameters(config)
        self.layer_types = list(config.layer_types)
        self.local_rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                            params["sliding_attention"], target)
        self.global_rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                             params["full_attention"], target)

    def layer_ropes(self, positions: torch.Tensor) -> list[Rope]:
        ropes = {"sliding_attention": self.local_rotary(positions),
                 "full_attention": self.global_rotary(positions)}
        return [ropes[kind] for kind in self.layer_types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
    # a multimodal checkpoint's names (as saved by transformers, older and newer layouts):
    # the language model's renamed, the vision tower and projector not used
    checkpoint_prefixes = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model.", "vision_tower.": None,
                           "model.vision_tower.": None, "multi_modal_projector.": None,
                           "model.multi_modal_projector.": None}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("gemma3_text with use_bidirectional_attention (an embedding model) "
                             "is not a causal LM; tessera serves causal generation only")
        unknown = set(config.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"gemma3_text: unknown layer_types {sorted(unknown)}")
        super().__init__(config, target)
