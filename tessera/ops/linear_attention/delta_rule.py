"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, Kimi Linear's KDA without its
per-channel gate), over a step's varlen rows, with a recurrent state per sequence.

Per value head the state S is a [Dk, Dv] matrix. A token with query q, key k (both
L2-normalised; q also scaled by Dk^-1/2), value v, decay g <= 0 (log space) and write
strength beta in (0, 1):

    S <- exp(g) S                  forget a little of everything
    S <- S + k (beta (v - S^T k))^T write the part of v that S does not already predict
    o  = S^T q

Decode rows apply this once. A prefill chunk runs it in blocks of CHUNK tokens: inside a
block the writes u_t = beta_t (v_t - S_t'^T k_t) depend on each other through a unit lower
triangular system, solved once for all blocks; only the hand-over of S between blocks is
sequential (the WY form of the DeltaNet papers). Everything runs in float32, as the
reference kernels (flash-linear-attention) and transformers do; the state is kept in
float32 between steps.

Key heads may be fewer than value heads: key head h serves value heads h * r ... h * r + r - 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.registry import register_op

CHUNK = 64


@register_op("delta_rule_gates", name="torch_delta_rule_gates", priority=0)
def delta_rule_gates_ref(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet's per-head gates from its projections a, b [T, Hv] and parameters
    A_log, dt_bias [Hv] -> (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), both
    float32 [T, Hv]; beta is the model dtype's sigmoid, as transformers computes it."""
    beta = torch.sigmoid(b).float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


def normalized_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hk, D] query and key -> float32 [T, Hv, D]: L2-normalised (eps 1e-6 under the
    root, as flash-linear-attention), the query scaled by D^-1/2, key heads repeated for
    the value heads they serve."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = num_v_heads // k.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    return q, k


@register_op("gated_delta_rule", name="torch_gated_delta_decode", priority=0, phases=("decode",))
def gated_delta_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence. q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv] float32;
    state: [slots, Hv, Dk, Dv] float32, updated in place for `slots` [B]. -> [B, Hv, Dv]."""
    q, k = normalized_qk(q, k, v.shape[1])
    s = state.index_select(0, slots) * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = (v.float() - predicted) * beta[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state.index_copy_(0, slots, s)
    return torch.einsum("bhkv,bhk->bhv", s, q).to(v.dtype)


@register_op("gated_delta_rule", name="torch_gated_delta_prefill", priority=0, phases=("prefill",))
def gated_delta_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slots: list[int],
                            query_lens: list[int], fresh: list[bool]) -> torch.Tensor:
    """The chunks of len(query_lens) sequences one after another (shapes as the decode op's,
    with T rows); each sequence starts from its state (zeros where `fresh`) and leaves its
    final state there."""
    q, k = normalized_qk(q, k, v.shape[1])
    outs, start = [], 0
    for slot, n, is_fresh in zip(slots, query_lens, fresh):
        rows = slice(start, start + n)
        s0 = torch.zeros_like(state[slot]) if is_fresh else state[slot]
        out, state[slot] = chunked_delta_rule(q[rows], k[rows], v[rows].float(), g[rows], beta[rows], s0)
        outs.append(out)
        start += n
    return torch.cat(outs).to(v.dtype)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H] (float32, q and k
    normalised), s0 [H, Dk, Dv] -> (outputs [L, H, Dv], final state)."""
    length = q.shape[0]
    pad = -length % CHUNK
    # padding tokens have k = 0, beta = 0 and g = 0: they neither decay nor write
    q, k, v, g, beta = (torch.nn.functional.pad(t.transpose(0, 1), (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
                        for t in (q, k, v, g, beta))
    heads = q.shape[0]
    q, k, v = (t.reshape(heads, -1, CHUNK, t.shape[-1]) for t in (q, k, v))  # [H, N, C, D]
    g, beta = g.reshape(heads, -1, CHUNK), beta.reshape(heads, -1, CHUNK)
    gamma = g.cumsum(-1)  # log of the decay from the block's start through each token
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(gamma_t - gamma_j): the decay between tokens j <= t of a block (0 above the diagonal)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # u = w - kc @ S_block_start solves (I + A) u = beta (v - exp(gamma) k S), A_tj =
    # beta_t (k_t . k_j) exp(gamma_t - gamma_j) for j < t
    system = (k_beta @ k.transpose(-1, -2)) * decay
    w = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    kc = torch.linalg.solve_triangular(system, k_beta * gamma.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # within the block, j <= t
    q_decayed = q * gamma.exp().unsqueeze(-1)  # reads the block's starting state
    k_to_end = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # its write, decayed to the block's end
    block_decay = gamma[..., -1].exp()
    s = s0
    out = torch.empty_like(v)
    for block in range(q.shape[1]):
        u = w[:, block] - kc[:, block] @ s
        out[:, block] = q_decayed[:, block] @ s + scores[:, block] @ u
        s = s * block_decay[:, block, None, None] + k_to_end[:, block].transpose(-1, -2) @ u
    return out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1), s
