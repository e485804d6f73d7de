"""TransformersCausalLM: a transformers causal LM behind tessera's model interface.

transformers' own modeling code runs every layer; tessera supplies the packed step (all
rows as one batch row, with per-token positions), the paged KV cache and attention, and
computes logits only for the rows that sample. Slower than a native folder (no fused or
packed ops), but any decoder-only model transformers implements runs correctly.
"""
from __future__ import annotations

import inspect
import re

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from tessera.models.transformers_fallback.attention import UnsupportedAttentionError, paged_layers
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


def head_scale(hf_model: PreTrainedModel, attr: str) -> tuple[str, float] | None:
    """("*" or "/", value) where the model's forward scales its logits by config `attr`; None
    where the config has no such value or the forward never uses it."""
    value = getattr(hf_model.config, attr, None)
    if value is None:
        return None
    source = inspect.getsource(type(hf_model).forward)
    ops = set(re.findall(rf"([*/])\s*self\.(?:config\.)?{attr}\b", source))
    if not ops:
        return None
    if len(ops) > 1:
        raise ValueError(f"{type(hf_model).__name__}: cannot tell how its forward applies {attr}")
    return ops.pop(), float(value)


class TransformersCausalLM(nn.Module):
    def __init__(self, hf_model: PreTrainedModel, target: OpTarget):
        super().__init__()
        self.hf_model = hf_model
        for name, module in hf_model.named_modules():  # refused at load, not at the first request
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                raise UnsupportedAttentionError(f"{name} ({type(module).__name__}) has attention sinks, which "
                                                "tessera's paged attention does not implement")
        self.decoder = hf_model.get_decoder()  # the stack without the LM head
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
        # logit post-processing transformers' LM heads apply: the config gives the value, the
        # model's own forward whether it multiplies or divides (cohere's logit_scale
        # multiplies, granite's logits_scaling divides, hyperclovax's multiplies)
        self.head_scales = [scale for attr in ("logit_scale", "logits_scaling")
                            if (scale := head_scale(hf_model, attr)) is not None]
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
        for op, value in self.head_scales:
            logits = logits * value if op == "*" else logits / value
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
