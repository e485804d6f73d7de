"""The Mamba-2 mixer the hybrid model folders share (transformers' Mamba2Mixer and the
hybrids' copies of it: Granite 4.0-H, Nemotron-H, Falcon-H1), its sizes named by
`Mamba2Shape` since every config spells them differently: in_proj packs [z | x | B | C | dt];
ops/linear_attention's Mamba2Scan runs the causal conv1d + SiLU over x, B, C and the SSD
scan (dt = softplus(dt + dt_bias) within time_step_limit, A = -exp(A_log), the D skip);
SiLU(z) gates the output, around an RMSNorm over groups of heads or alone; out_proj.

Tensor parallelism splits the heads (x, z, dt and their conv channels); B and C belong to
groups of heads, split with them when the groups divide over the ranks, or held whole by
every rank when there is one group (Granite 4.0-H). A group that spans ranks is normalised
by its mean square summed over them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.parallel import Span, all_reduce, even_span
from tessera.ops.linear import PackedLinear, RowParallelLinear
from tessera.ops.linear_attention import Mamba2Scan
from tessera.ops.registry import OpTarget
from tessera.ops.weights import make_param, row_spans_loader


class MambaSplit:
    """This rank's heads and groups, and their rows in the full tensors."""

    def __init__(self, heads: int, head_dim: int, groups: int, state: int, target: OpTarget):
        tp, rank = target.tp_size, target.tp_rank
        if heads % tp:
            raise ValueError(f"Mamba-2: {heads} heads do not split over {tp} tensor-parallel ranks")
        if groups % tp == 0:
            group_span = even_span(groups, rank, tp)
        elif groups == 1:
            group_span = Span(0, 1)  # B and C whole on every rank
        else:
            raise ValueError(f"Mamba-2: {groups} groups do not split over {tp} tensor-parallel ranks")
        self.heads = even_span(heads, rank, tp)
        self.groups = group_span
        self.x_rows = Span(self.heads.start * head_dim, self.heads.size * head_dim)
        self.bc_rows = Span(group_span.start * state, group_span.size * state)
        self.norm_spans_ranks = groups < tp  # one group over every rank's heads


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # how SiLU(z) meets the output: "gate_first" (gated, then an RMSNorm per group: Granite,
    # Nemotron-H), "norm_first" (normalised per group, then gated), "none" (gated only)
    norm: str = "gate_first"
    in_multiplier: float = 1.0  # the input scaled before in_proj (Falcon-H1's muP)
    # the projection's [z, x, B, C, dt] parts scaled after it (Falcon-H1's mup_vector)
    projection_multipliers: tuple[float, float, float, float, float] | None = None
    out_proj_bias: bool | None = None  # (None: as proj_bias; Falcon-H1 sets it apart)


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, target: OpTarget):
        super().__init__()
        heads, head_dim, groups, state = shape.num_heads, shape.head_dim, shape.num_groups, shape.state_size
        inner = heads * head_dim
        self.split = split = MambaSplit(heads, head_dim, groups, state, target)
        self.group_size, self.eps, self.tp_size = inner // groups, shape.eps, target.tp_size
        self.core = Mamba2Scan(split.heads.size, head_dim, split.groups.size, state, shape.conv_kernel,
                               shape.time_step_limit, target)
        bc = groups * state
        self.in_proj = PackedLinear(
            shape.hidden_size, {"z": inner, "x": inner, "B": bc, "C": bc, "dt": heads}, target, bias=shape.proj_bias,
            shard_spans={"z": split.x_rows, "x": split.x_rows, "B": split.bc_rows, "C": split.bc_rows,
                         "dt": split.heads})
        # this rank's conv channels (its x rows, its groups' B and C rows), head vectors, norm weight
        conv = row_spans_loader(inner + 2 * bc, [(0, split.x_rows), (inner, split.bc_rows),
                                                 (inner + bc, split.bc_rows)], "conv1d")
        self.conv_weight = make_param((self.core.conv_dim, shape.conv_kernel), target.dtype, target.device,
                                      loader=conv)
        self.conv_bias = (make_param((self.core.conv_dim,), target.dtype, target.device, loader=conv)
                          if shape.conv_bias else None)
        heads_loader = row_spans_loader(heads, [(0, split.heads)], "per-head vector")
        self.dt_bias, self.A_log, self.D = (make_param((split.heads.size,), target.dtype, target.device,
                                                       loader=heads_loader) for _ in range(3))
        if shape.norm not in ("gate_first", "norm_first", "none"):
            raise ValueError(f"Mamba-2: unknown output norm {shape.norm!r}")
        self.norm = shape.norm
        self.norm_weight = (make_param((split.x_rows.size,), target.dtype, target.device,
                                       loader=row_spans_loader(inner, [(0, split.x_rows)], "norm weight"))
                            if shape.norm != "none" else None)
        self._norm = target.op("gated_rms_norm")
        self._gate = target.op("silu_mul")  # (norm "none")
        self._scale = target.op("sum_and_scale")  # the muP multipliers, by a number or by column
        self.A: torch.Tensor | None = None  # -exp(A_log) in float32, once loaded (prepare_weights)
        self.in_multiplier = shape.in_multiplier
        self.projection_scale = None
        if shape.projection_multipliers is not None:  # one factor per local row of [z | x | B | C | dt]
            sizes = list(self.in_proj.shard_sizes.values())
            scale = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, shape.projection_multipliers)])
            self.projection_scale = scale.to(target.device, target.dtype)
        out_bias = shape.proj_bias if shape.out_proj_bias is None else shape.out_proj_bias
        self.out_proj = RowParallelLinear(inner, shape.hidden_size, target, bias=out_bias, in_span=split.x_rows)

    def prepare_weights(self) -> None:
        """A = -exp(A_log), computed once: per step it was two torch ops a layer, which
        also kept decode steps from the kernel graphs."""
        self.A = -self.A_log.float().exp()

    def forward(self, rope, hidden: torch.Tensor) -> torch.Tensor:
        out = self.in_proj(self._scale(hidden, None, self.in_multiplier) if self.in_multiplier != 1.0 else hidden)
        if self.projection_scale is not None:
            out = self._scale(out, None, self.projection_scale)
        z_end = self.split.x_rows.size
        conv_end = z_end + self.core.conv_dim
        z, xbc, dt = out[:, :z_end], out[:, z_end:conv_end], out[:, conv_end:]
        A = self.A if self.A is not None else -self.A_log.float().exp()
        y = self.core(xbc, self.conv_weight, self.conv_bias, dt, self.dt_bias, A, self.D)
        return self.out_proj(self._gated_norm(y, z))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """SiLU(z) gates y, before or after an RMSNorm per group of heads (over the ranks where
        the one group spans them), or alone."""
        if self.norm == "none":
            return self._gate(z, y)
        gate_first = self.norm == "gate_first"
        if not self.split.norm_spans_ranks:
            return self._norm(y, z, self.norm_weight, self.eps, gate_first, self.group_size)
        rows = y.float() * F.silu(z.float()) if gate_first else y.float()
        squares = all_reduce(rows.pow(2).sum(-1, keepdim=True), self.tp_size)
        normed = rows * torch.rsqrt(squares / self.group_size + self.eps)
        if gate_first:
            return self.norm_weight * normed.to(y.dtype)
        return (self.norm_weight.float() * normed * F.silu(z.float())).to(y.dtype)
