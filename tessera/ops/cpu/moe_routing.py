"""MoE routing on CPU in one C call: softmax top-k of bf16 router logits (moe_layer.c's
tessera_moe_softmax_topk), and the scored routers (moe_router.h: DeepSeek's, GLM-4.5's,
ERNIE's, LFM2-MoE's; their float32 router GEMV included). With the one-call experts
(ops/cpu/moe_experts.py) a mixture's decode step is kernels alone, which its kernel graph
replays. The weights are torch's float32 ones to within rounding (expf, one sum order); of
equal choices the lower expert comes first.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import Kernel
from tessera.ops.cpu.moe_experts import MAX_TOP_K
from tessera.ops.moe import scored_topk_ref, softmax_topk_ref
from tessera.ops.registry import register_op

_KERNEL = Kernel("moe_layer.c", "tessera_moe_softmax_topk",
                 (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,) * 2, ctypes.c_int)


@register_op("moe_routing", name="cpu_softmax_topk", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def softmax_topk_bf16(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      expert_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk_ref's (weights [T, k] float32, expert ids [T, k] int64); `expert_scales`
    bf16 [E], contiguous."""
    if not (router_logits.dtype == torch.bfloat16 and router_logits.dim() == 2 and router_logits.is_contiguous()
            and 0 < top_k <= min(MAX_TOP_K, router_logits.shape[1])
            and (expert_scales is None or (expert_scales.dtype == torch.bfloat16 and expert_scales.is_contiguous()
                                           and expert_scales.shape == router_logits.shape[1:]))):
        return softmax_topk_ref(router_logits, top_k, renormalize, expert_scales)
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=torch.int64)
    if tokens:
        _KERNEL(router_logits.data_ptr(), 0 if expert_scales is None else expert_scales.data_ptr(),
                weights.data_ptr(), ids.data_ptr(), tokens, experts, top_k, int(renormalize),
                torch.get_num_threads())  # (its one failure, k out of range, is checked above)
    return weights, ids


_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SCORED = Kernel("moe_router.c", "tessera_moe_scored_topk",
                 (_P, _I64, _INT, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT, _I64, _I64, _INT, _INT, _F, _F, _F, _INT),
                 _INT, fallback_source="moe_router_avx2.c")
_GROUP_RULES = {"max": 0, "top2_sum": 1}
# up to a decode graph's largest bucket the router GEMV runs in the call (level with torch's
# F.linear at 1-8 tokens, 1.5x its time at 32); longer steps take torch's GEMM (8x faster at 512)
GEMV_MAX_TOKENS = 32


@register_op("moe_scored_routing", name="cpu_scored_topk", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16, torch.float32), check=_SCORED.check)
def scored_topk(logits: torch.Tensor, top_k: int, sigmoid: bool = False, bias: torch.Tensor | None = None,
                groups: int = 1, topk_group: int = 1, group_rule: str = "top2_sum", renormalize: bool = False,
                renorm_eps: float = 0.0, renorm_floor: float = 0.0, scaling: float = 1.0,
                router_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scored_topk_ref's op in one call (moe_router.h); its float32 sums run in another order
    than torch's, so weights agree to float32 rounding."""
    experts = logits.shape[1] if router_weight is None else router_weight.shape[0]
    per_group = experts // groups if groups > 0 else 0
    if not (logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(1) == 1
            and 0 < top_k <= min(MAX_TOP_K, experts) and groups >= 1 and experts % groups == 0
            and 1 <= topk_group <= min(groups, MAX_TOP_K) and topk_group * per_group >= top_k
            and group_rule in _GROUP_RULES and (group_rule != "top2_sum" or groups == 1 or per_group >= 2)
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (experts,) and bias.is_contiguous()))
            and (router_weight is None or (router_weight.dtype == torch.float32 and router_weight.is_contiguous()
                                           and router_weight.shape[1] == logits.shape[1]))):
        return scored_topk_ref(logits, top_k, sigmoid, bias, groups, topk_group, group_rule, renormalize,
                               renorm_eps, renorm_floor, scaling, router_weight)
    tokens = logits.shape[0]
    if router_weight is not None and tokens > GEMV_MAX_TOKENS:
        # prefill: torch's GEMM (MKL) reads the router's rows far fewer times
        logits, router_weight = F.linear(logits.float(), router_weight), None
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=torch.int64)
    if tokens and _SCORED(logits.data_ptr(), logits.stride(0), int(logits.dtype == torch.bfloat16),
                          0 if router_weight is None else router_weight.data_ptr(),
                          0 if router_weight is None else router_weight.shape[1],
                          0 if bias is None else bias.data_ptr(),
                          weights.data_ptr(), ids.data_ptr(), tokens, experts, top_k, int(sigmoid), groups, topk_group,
                          _GROUP_RULES[group_rule], int(renormalize), renorm_eps, renorm_floor, scaling,
                          torch.get_num_threads()):
        raise MemoryError("the scored MoE routing could not allocate its buffers")
    return weights, ids
