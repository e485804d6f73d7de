"""How one model is cut across tensor-parallel ranks, and the collectives that join it.

Every rank builds the same model with its own `OpTarget.tp_rank`; layers ask here which
slice of each dimension they own. Splits need not be even (SmolLM2's 9 query / 3 KV heads
go 3+6 over two ranks): attention is cut along KV-head groups so each rank keeps whole GQA
groups, and when there are fewer KV heads than ranks each KV head is replicated on the
ranks that share its group's query heads. With one rank every collective is a no-op and
no process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class TensorParallelError(ValueError):
    """A model shape cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class Span:
    """Rows [start, start + size) of a dimension of the full (unsharded) tensor."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def even_span(total: int, rank: int, size: int) -> Span:
    """Near-even contiguous split: rank r owns [r*total//size, (r+1)*total//size)."""
    start, end = rank * total // size, (rank + 1) * total // size
    return Span(start, end - start)


def padded_span(total: int, rank: int, size: int) -> Span:
    """Equal chunks of ceil(total / size) (the last may run past `total`; vocab-parallel
    layers pad it so every rank's logits have the same width for all_gather)."""
    chunk = -(-total // size)
    return Span(rank * chunk, chunk)


@dataclass(frozen=True)
class HeadSplit:
    """The query and KV heads one rank computes."""

    q: Span
    kv: Span


def split_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadSplit:
    if num_heads % num_kv_heads:
        raise TensorParallelError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if size == 1:
        return HeadSplit(Span(0, num_heads), Span(0, num_kv_heads))
    if num_kv_heads >= size:
        kv = even_span(num_kv_heads, rank, size)
        return HeadSplit(Span(kv.start * group, kv.size * group), kv)
    if size % num_kv_heads:
        raise TensorParallelError(
            f"{num_kv_heads} KV heads cannot be replicated evenly over {size} ranks "
            f"(use a tensor-parallel size that divides or is a multiple of {num_kv_heads})")
    sharing = size // num_kv_heads  # ranks that replicate one KV head
    if group < sharing:
        raise TensorParallelError(f"{num_heads} query heads cannot be split over {size} ranks")
    kv_head = rank // sharing
    part = even_span(group, rank % sharing, sharing)
    return HeadSplit(Span(kv_head * group + part.start, part.size), Span(kv_head, 1))


def check_split(what: str, total: int, size: int) -> None:
    if total < size:
        raise TensorParallelError(f"{what} ({total}) is smaller than the tensor-parallel size {size}")


def all_reduce(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sum `x` over the ranks in place (no-op for one rank)."""
    if size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension (same shape on every rank)."""
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
