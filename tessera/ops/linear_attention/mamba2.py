"""Mamba-2's selective state space scan (SSD) and the layer around it (Granite 4.0-H's,
Nemotron-H's, Falcon-H1's and Bamba's mixers), over a step's varlen rows with a recurrent
state per sequence.

Per head h the state S is a [P, N] matrix (head_dim x d_state). A token with input x [P],
time step dt = clamp(softplus(dt_raw + dt_bias), limits), B and C [N] (shared by the heads
of a group) and the head's A < 0:

    S <- exp(dt A) S + dt x B^T
    y  = S C + D x

Decode rows apply this once. A prefill chunk runs it in blocks of CHUNK tokens (the SSD
form): within a block, y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j plus the
block's starting state read through exp(cum_i) C_i; only the state's hand-over between
blocks is sequential. Float32 throughout, the state kept in float32 between steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.linear_attention.layer import RecurrentLayer, StateShape
from tessera.ops.registry import OpTarget, register_op

CHUNK = 64


def _time_steps(dt: torch.Tensor, dt_bias: torch.Tensor, limits: tuple[float, float]) -> torch.Tensor:
    return F.softplus(dt.float() + dt_bias.float()).clamp(limits[0], limits[1])


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] -> float32 [T, H, N]: each group's vector for its heads."""
    return t.float().repeat_interleave(num_heads // t.shape[1], dim=1)


@register_op("ssm_scan", name="torch_ssm_scan_decode", priority=0, phases=("decode",))
def ssm_scan_decode_ref(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                        B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, limits: tuple[float, float],
                        state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence. x: [B, H, P]; dt: [B, H] (before softplus); dt_bias, A, D:
    [H]; B, C: [B, G, N]; state: [slots, H, P, N] float32, updated in place for `slots`.
    -> [B, H, P] in x's dtype."""
    heads = x.shape[1]
    step = _time_steps(dt, dt_bias, limits)
    xf = x.float()
    s = state.index_select(0, slots) * (step * A.float()).exp()[..., None, None]
    s = s + (step[..., None] * xf).unsqueeze(-1) * _per_head(B, heads).unsqueeze(2)
    state.index_copy_(0, slots, s)
    y = torch.einsum("bhpn,bhn->bhp", s, _per_head(C, heads)) + D.float()[:, None] * xf
    return y.to(x.dtype)


@register_op("ssm_scan", name="torch_ssm_scan_prefill", priority=0, phases=("prefill",))
def ssm_scan_prefill_ref(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                         B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, limits: tuple[float, float],
                         state: torch.Tensor, slots: list[int], query_lens: list[int],
                         fresh: list[bool]) -> torch.Tensor:
    """The chunks of len(query_lens) sequences one after another (shapes as the decode op's,
    with T rows); each starts from its state (zeros where `fresh`) and leaves its final one."""
    heads = x.shape[1]
    step = _time_steps(dt, dt_bias, limits)
    Bh, Ch, xf = _per_head(B, heads), _per_head(C, heads), x.float()
    outs, start = [], 0
    for slot, n, is_fresh in zip(slots, query_lens, fresh):
        rows = slice(start, start + n)
        s0 = torch.zeros_like(state[slot]) if is_fresh else state[slot]
        y, state[slot] = chunked_scan(xf[rows], step[rows], A.float(), Bh[rows], Ch[rows], s0)
        outs.append(y + D.float()[:, None] * xf[rows])
        start += n
    return torch.cat(outs).to(x.dtype)


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, H, P], dt [L, H], A [H], B, C [L, H, N] (float32), s0 [H, P, N]
    -> (outputs without the D skip [L, H, P], final state)."""
    length = x.shape[0]
    pad = -length % CHUNK
    # padding tokens have dt = 0: they neither decay the state nor write to it
    x, B, C = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (x, B, C))  # [H, L', D]
    dt = F.pad(dt.t(), (0, pad))                                            # [H, L']
    heads = x.shape[0]
    x, B, C = (t.reshape(heads, -1, CHUNK, t.shape[-1]) for t in (x, B, C))  # [H, K, C, D]
    dt = dt.reshape(heads, -1, CHUNK)
    gamma = (dt * A[:, None, None]).cumsum(-1)  # log of the decay from the block's start
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    scores = (C @ B.transpose(-1, -2)) * decay * dt.unsqueeze(-2)  # [H, K, C, C]: token i from j
    inside = scores @ x
    c_decayed = C * gamma.exp().unsqueeze(-1)  # reads the block's starting state
    # each token's write, decayed to the block's end: dt_j exp(gamma_end - gamma_j) x_j B_j^T
    x_to_end = x * (dt * (gamma[..., -1:] - gamma).exp()).unsqueeze(-1)
    block_decay = gamma[..., -1].exp()
    s = s0
    out = torch.empty_like(x)
    for block in range(x.shape[1]):
        out[:, block] = inside[:, block] + c_decayed[:, block] @ s.transpose(-1, -2)
        s = s * block_decay[:, block, None, None] + x_to_end[:, block].transpose(-1, -2) @ B[:, block]
    return out.reshape(heads, -1, x.shape[-1])[:, :length].transpose(0, 1), s


class Mamba2Scan(RecurrentLayer):
    """Causal conv1d + SiLU over the packed [x | B | C] rows, then the SSD scan. State: the
    conv's last K - 1 inputs (model dtype) and the [H, P, N] matrices (float32)."""

    def __init__(self, num_heads: int, head_dim: int, num_groups: int, state_size: int, conv_kernel: int,
                 time_step_limit: tuple[float, float], target: OpTarget):
        super().__init__()
        if num_heads % num_groups:
            raise ValueError(f"Mamba-2: heads ({num_heads}) must be a multiple of groups ({num_groups})")
        self.num_heads, self.head_dim, self.num_groups, self.state_size = num_heads, head_dim, num_groups, state_size
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * num_groups * state_size
        self.conv_kernel = conv_kernel
        self.limits = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.dtype = target.dtype
        self._conv_decode = target.op("causal_conv1d", phase="decode")
        self._conv_prefill = target.op("causal_conv1d", phase="prefill")
        self._scan_decode = target.op("ssm_scan", phase="decode")
        self._scan_prefill = target.op("ssm_scan", phase="prefill")

    def state_shapes(self) -> list[StateShape]:
        return [((self.conv_dim, self.conv_kernel - 1), self.dtype),
                ((self.num_heads, self.head_dim, self.state_size), torch.float32)]

    def forward(self, xbc: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
        """xbc: [T, conv_dim]; dt: [T, H] (before softplus); A: [H] (negative) -> [T, H * P]."""
        _, (conv_state, ssm_state) = self.bound_state()

        def decode(rows: slice, slots: torch.Tensor) -> torch.Tensor:
            conv = self._conv_decode(xbc[rows], conv_weight, conv_bias, conv_state, slots)
            return self._scan_decode(*self._split(conv), dt[rows], dt_bias, A, *self._bc(conv), D, self.limits,
                                     ssm_state, slots)

        def prefill(rows: slice, slots: list[int], lens: list[int], fresh: list[bool]) -> torch.Tensor:
            conv = self._conv_prefill(xbc[rows], conv_weight, conv_bias, conv_state, slots, lens, fresh)
            return self._scan_prefill(*self._split(conv), dt[rows], dt_bias, A, *self._bc(conv), D, self.limits,
                                      ssm_state, slots, lens, fresh)

        out = self.by_phase(xbc.shape[0], decode, prefill)
        return out.reshape(out.shape[0], -1)

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor]:
        return (conv[:, :self.inner].reshape(-1, self.num_heads, self.head_dim),)

    def _bc(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.num_groups * self.state_size
        B, C = conv[:, self.inner:self.inner + size], conv[:, self.inner + size:]
        return B.reshape(-1, self.num_groups, self.state_size), C.reshape(-1, self.num_groups, self.state_size)
