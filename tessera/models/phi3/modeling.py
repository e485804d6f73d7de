"""Phi-3: the Llama stack (no biases, SiLU gate-up MLP, RMSNorm) whose checkpoints already
store the fused `qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate, up) tensors:
they match tessera's PackedLinear layouts, so they load whole (shard_id None) and nothing
is renamed. Attention uses config.sliding_window (Mistral's layers). Rope kinds (default, longrope with Phi-3's attention scaling, ...) come from
the shared RotaryEmbedding."""
from __future__ import annotations

from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaForCausalLM
from tessera.models.mistral.modeling import MistralModel
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import rope_parameters


def check_phi3_config(config: PretrainedConfig) -> None:
    """Refuse what tessera cannot compute exactly, rather than compute something else."""
    partial = rope_parameters(config).get("partial_rotary_factor",
                                          getattr(config, "partial_rotary_factor", 1.0))
    if partial is not None and partial < 1.0:
        raise ValueError(f"phi3: partial rotary (partial_rotary_factor={partial}) is not supported; "
                         "tessera's rotary op rotates the whole head")


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's qkv_proj / gate_up_proj names are already ours: no shards to route.
    # Separate q_proj / gate_proj tensors would be unexpected (an error), not silently packed.
    packed_modules_mapping: dict = {}
    # Attention as transformers' Phi3: sliding window when config.sliding_window is set
    # (Phi-3-mini-4k: 2047), full causal otherwise -- Mistral's layers do exactly that.
    model_cls = MistralModel

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        check_phi3_config(config)
        super().__init__(config, target)
