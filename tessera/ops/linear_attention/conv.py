"""The short causal depthwise convolution before linear attention (Qwen3-Next's and
Qwen3.5's Gated DeltaNet, Mamba's conv1d), with SiLU, over a step's varlen rows; and the same
convolution without activation between LFM2's gates (`short_conv`: C * conv(B * x)).

Each sequence's conv state holds its last kernel - 1 inputs, so a chunk (or a decode
token) continues its sequence exactly as one long convolution would. A sequence whose
state is fresh (its chunk starts at position 0) sees zeros before its first token, the
convolution's left padding.

Rounding follows transformers' torch path: the convolution's sum in float32, rounded to
the model dtype (then SiLU in the model dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.registry import register_op


@register_op("causal_conv1d", name="torch_causal_conv1d_decode", priority=0, phases=("decode",))
def causal_conv1d_decode_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [B, C] one token per sequence; weight: [C, K]; conv_state: [slots, C, K - 1],
    updated in place for the rows' `slots` [B]."""
    return F.silu(conv_decode_sums(x, weight, bias, conv_state, slots).to(x.dtype))


@register_op("causal_conv1d", name="torch_causal_conv1d_prefill", priority=0, phases=("prefill",))
def causal_conv1d_prefill_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              conv_state: torch.Tensor, slots: list[int], query_lens: list[int],
                              fresh: list[bool]) -> torch.Tensor:
    """x: [T, C], the chunks of len(query_lens) sequences one after another; each
    sequence's state (`slots`) is read unless `fresh` and replaced by its chunk's last
    K - 1 inputs."""
    return F.silu(conv_prefill_sums(x, weight, bias, conv_state, slots, query_lens, fresh).to(x.dtype))


def conv_decode_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The decode convolution's float32 sums, before any activation; the state updated."""
    window = torch.cat((conv_state.index_select(0, slots), x.unsqueeze(-1).to(conv_state.dtype)), dim=-1)
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    out = (window.float() * weight.float()).sum(-1)
    return out if bias is None else out + bias.float()


def conv_prefill_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      slots: list[int], query_lens: list[int], fresh: list[bool]) -> torch.Tensor:
    """The prefill convolution's float32 sums, before any activation; the states updated."""
    channels, width = weight.shape
    kernel = weight.float().unsqueeze(1)  # [C, 1, K]: depthwise
    bias32 = None if bias is None else bias.float()
    outs, start = [], 0
    for slot, n, is_fresh in zip(slots, query_lens, fresh):
        chunk = x[start:start + n].t()  # [C, n]
        before = (torch.zeros(channels, width - 1, dtype=conv_state.dtype, device=x.device) if is_fresh
                  else conv_state[slot])
        full = torch.cat((before, chunk.to(conv_state.dtype)), dim=-1)  # [C, K - 1 + n]
        conv_state[slot] = full[:, full.shape[1] - (width - 1):]
        outs.append(F.conv1d(full.float().unsqueeze(0), kernel, bias32, groups=channels)[0].t())  # [n, C]
        start += n
    return torch.cat(outs)


@register_op("short_conv", name="torch_short_conv_decode", priority=0, phases=("decode",))
def short_conv_decode_ref(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution, decode rows: bcx [B, 3C] packs B, C and x; C times the
    causal convolution (no activation) of B x, [B, C]."""
    b, c, x = bcx.split(weight.shape[0], dim=-1)
    return c * conv_decode_sums(b * x, weight, bias, conv_state, slots).to(bcx.dtype)


@register_op("short_conv", name="torch_short_conv_prefill", priority=0, phases=("prefill",))
def short_conv_prefill_ref(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           conv_state: torch.Tensor, slots: list[int], query_lens: list[int],
                           fresh: list[bool]) -> torch.Tensor:
    """The gated short convolution over prefill chunks."""
    b, c, x = bcx.split(weight.shape[0], dim=-1)
    return c * conv_prefill_sums(b * x, weight, bias, conv_state, slots, query_lens, fresh).to(bcx.dtype)
