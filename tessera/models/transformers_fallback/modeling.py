"""TransformersCausalLM: a transformers causal LM behind tessera's model interface.

transformers' own modeling code runs every layer; tessera supplies the packed step (all
rows as one batch row, with per-token positions), the paged KV cache and attention, and
computes logits only for the rows that sample. Slower than a native folder (no fused or
packed ops), but any decoder-only model transformers implements runs correctly.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from tessera.models.transformers_fallback.attention import paged_layers
from tessera.ops.attention import Attention
from tessera.ops.registry import OpTarget


def layer_window(config: PretrainedConfig, index: int) -> int | None:
    """The sliding window of layer `index` as transformers' configs declare it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[index] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class TransformersCausalLM(nn.Module):
    def __init__(self, hf_model: PreTrainedModel, target: OpTarget):
        super().__init__()
        self.hf_model = hf_model
        self.decoder = hf_model.base_model  # the stack without the LM head
        self.lm_head = hf_model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(hf_model).__name__} has no output embeddings (LM head)")
        cfg = hf_model.config
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        # one tessera layer per transformer layer: owns that layer's slice of the paged cache
        # (its scale is replaced by the module's own `scaling` on every call)
        self.paged_attention = nn.ModuleList(
            Attention(num_heads, head_dim, num_kv_heads, head_dim ** -0.5, target,
                      sliding_window=layer_window(cfg, i), softcap=softcap)
            for i in range(cfg.num_hidden_layers))
        # logit post-processing transformers' LM heads apply, read from the config
        self.logit_scale = getattr(cfg, "logit_scale", None)             # multiplied (cohere)
        self.logits_scaling = getattr(cfg, "logits_scaling", None)       # divided (granite)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        with paged_layers(self.paged_attention) as calls:
            out = self.decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                               use_cache=False)
        if calls[0] != len(self.paged_attention):
            raise RuntimeError(
                f"{type(self.hf_model).__name__} made {calls[0]} paged attention calls for "
                f"{len(self.paged_attention)} layers: its attention does not go through "
                "transformers' attention interface, so the fallback cannot serve it")
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
