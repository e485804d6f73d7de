"""Qwen3.5's language models as image-text checkpoints run them: the same stacks with
interleaved M-RoPE over the rotary quarter of each head (image tokens take (t, h, w)
positions, text tokens equal ones, which is plain rotary), beside Qwen3-VL's vision
transformer without DeepStack (transformers' modules, multimodal/encoder.py)."""
from __future__ import annotations

from transformers import PretrainedConfig

from tessera.models.llama.modeling import rotary_dim_of
from tessera.models.qwen3_next.modeling import Qwen3NextForCausalLM, Qwen3NextModel
from tessera.models.qwen3_next.moe import Qwen3NextMoeForCausalLM, Qwen3NextMoeModel
from tessera.models.qwen3_vl.modeling import interleaved_mrope
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import MRotaryEmbedding


class MRopeRotary:
    """Mixed in before a Qwen3-Next model class: its rotary table takes 3-D positions."""

    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> MRotaryEmbedding:
        return interleaved_mrope(config, target, rotary_dim_of(config))


class Qwen3_5VLTextModel(MRopeRotary, Qwen3NextModel):
    pass


class Qwen3_5MoeVLTextModel(MRopeRotary, Qwen3NextMoeModel):
    pass


class Qwen3_5VLForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5VLTextModel


class Qwen3_5MoeVLForCausalLM(Qwen3NextMoeForCausalLM):
    model_cls = Qwen3_5MoeVLTextModel
