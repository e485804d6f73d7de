"""Packed projections whose checkpoint tensors interleave their parts per head group
(ops/linear.py: RegroupedLinear).

Qwen3-Next's `in_proj_qkvz` stores, for each key head, its query, key, and the values
and gates of the value heads it serves, one group after another; its `in_proj_ba` does
the same with beta and the decay input. The gated attention's `q_proj` interleaves each
head's query and output gate. Loaded, they are regrouped into one shard per part (all
queries, then all keys, ...), so the forward is a plain split, and tensor parallelism
slices each part by heads as for any packed layer."""
from __future__ import annotations

from tessera.distributed.parallel import Span, even_span, split_heads
from tessera.ops.linear import RegroupedLinear
from tessera.ops.registry import OpTarget

def head_rows(heads: Span, head_dim: int) -> Span:
    return Span(heads.start * head_dim, heads.size * head_dim)


class GatedQKVLinear(RegroupedLinear):
    """Q, output gate, K and V of gated attention: the checkpoint's q_proj holds each
    head's query then its gate (shard "q_gate"); k_proj and v_proj are plain."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 target: OpTarget, bias: bool = False):
        heads = split_heads(num_heads, num_kv_heads, target.tp_rank, target.tp_size)
        q_rows, kv_rows = head_rows(heads.q, head_dim), head_rows(heads.kv, head_dim)
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": full_q, "gate": full_q, "k": full_kv, "v": full_kv}, target,
                         layouts={"q_gate": (num_heads, (("q", head_dim), ("gate", head_dim)))},
                         checkpoint_shards=("q_gate", "k", "v"),
                         shard_spans={"q": q_rows, "gate": q_rows, "k": kv_rows, "v": kv_rows}, bias=bias)
        self.num_heads, self.num_kv_heads = heads.q.size, heads.kv.size  # this rank's
        self.o_proj_span = q_rows


class DeltaNetSplit:
    """How a Gated DeltaNet's heads divide over tensor-parallel ranks: whole key heads,
    each with the value heads it serves."""

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, target: OpTarget):
        if num_k_heads % target.tp_size:
            raise ValueError(f"linear attention: {num_k_heads} key heads do not split over "
                             f"{target.tp_size} tensor-parallel ranks")
        ratio = num_v_heads // num_k_heads
        self.k_heads = even_span(num_k_heads, target.tp_rank, target.tp_size)
        self.v_heads = Span(self.k_heads.start * ratio, self.k_heads.size * ratio)
        self.k_rows, self.v_rows = head_rows(self.k_heads, head_k_dim), head_rows(self.v_heads, head_v_dim)
        self.ratio = ratio


def qkvz_projection(hidden_size: int, split: DeltaNetSplit, num_k_heads: int, head_k_dim: int,
                    head_v_dim: int, target: OpTarget) -> RegroupedLinear:
    """[q | k | v | z] rows; Qwen3.5 stores in_proj_qkv (shard "qkv") and in_proj_z,
    Qwen3-Next one in_proj_qkvz grouped by key head."""
    key_dim, value_dim = num_k_heads * head_k_dim, num_k_heads * split.ratio * head_v_dim
    group_v = split.ratio * head_v_dim
    return RegroupedLinear(
        hidden_size, {"q": key_dim, "k": key_dim, "v": value_dim, "z": value_dim}, target,
        layouts={"qkv": (1, (("q", key_dim), ("k", key_dim), ("v", value_dim))),
                 None: (num_k_heads, (("q", head_k_dim), ("k", head_k_dim), ("v", group_v), ("z", group_v)))},
        checkpoint_shards=("qkv", "z"),
        shard_spans={"q": split.k_rows, "k": split.k_rows, "v": split.v_rows, "z": split.v_rows})


def ba_projection(hidden_size: int, split: DeltaNetSplit, num_k_heads: int, target: OpTarget) -> RegroupedLinear:
    """[b | a] rows, one each per value head; Qwen3.5 stores in_proj_b and in_proj_a,
    Qwen3-Next one in_proj_ba grouped by key head."""
    num_v = num_k_heads * split.ratio
    return RegroupedLinear(
        hidden_size, {"b": num_v, "a": num_v}, target,
        layouts={None: (num_k_heads, (("b", split.ratio), ("a", split.ratio)))},
        checkpoint_shards=("b", "a"), shard_spans={"b": split.v_heads, "a": split.v_heads})
