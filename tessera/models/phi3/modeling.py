"""Phi-3: the Llama stack (no biases, SiLU gate-up MLP, RMSNorm) whose checkpoints already
store the fused `qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate, up) tensors:
they match tessera's PackedLinear layouts, so they load whole (shard_id None) and nothing
is renamed. Attention uses config.sliding_window (Mistral's layers). Rope kinds (default,
longrope with Phi-3's attention scaling, ...) come from the shared RotaryEmbedding, over
partial_rotary_factor of each head where the config says so (Phi-4-mini: 0.75)."""
from __future__ import annotations

from tessera.models.llama.modeling import LlamaForCausalLM
from tessera.models.mistral.modeling import MistralModel


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's qkv_proj / gate_up_proj names are already ours: no shards to route.
    # Separate q_proj / gate_proj tensors would be unexpected (an error), not silently packed.
    packed_modules_mapping: dict = {}
    # Attention as transformers' Phi3: sliding window when config.sliding_window is set
    # (Phi-3-mini-4k: 2047), full causal otherwise -- Mistral's layers do exactly that.
    model_cls = MistralModel
