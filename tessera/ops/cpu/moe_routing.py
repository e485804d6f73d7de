"""Softmax top-k routing on CPU in one C call (moe_layer.c's tessera_moe_softmax_topk), for
bf16 router logits: with the one-call experts (ops/cpu/moe_experts.py) a mixture's decode
step is kernels alone, which its kernel graph replays. The weights are torch's float32
softmax to within rounding (expf, one sum order); of equal logits the lower expert comes
first.
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.cpu.moe_experts import MAX_TOP_K
from tessera.ops.moe import softmax_topk_ref
from tessera.ops.registry import register_op

_KERNEL = Kernel("moe_layer.c", "tessera_moe_softmax_topk",
                 (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3 + (ctypes.c_int,) * 2, ctypes.c_int)


@register_op("moe_routing", name="cpu_softmax_topk", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def softmax_topk_bf16(router_logits: torch.Tensor, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk_ref's (weights [T, k] float32, expert ids [T, k] int64)."""
    if not (router_logits.dtype == torch.bfloat16 and router_logits.dim() == 2 and router_logits.is_contiguous()
            and 0 < top_k <= min(MAX_TOP_K, router_logits.shape[1])):
        return softmax_topk_ref(router_logits, top_k, renormalize)
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=torch.int64)
    if tokens:
        _KERNEL(router_logits.data_ptr(), weights.data_ptr(), ids.data_ptr(), tokens, experts, top_k,
                int(renormalize), torch.get_num_threads())  # (its one failure, k out of range, is checked above)
    return weights, ids
