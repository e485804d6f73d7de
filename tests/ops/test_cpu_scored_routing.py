"""The scored MoE routing kernel (moe_router.h) against its torch builder: DeepSeek V2's
softmax (greedy and group-limited), V3's sigmoid with a choice bias over groups (GLM-4.5,
MiniMax-M2, Nemotron 3), Mistral 4's, ERNIE 4.5's floor and LFM2-MoE's, from bf16 or float32
logits or from hidden rows and a float32 router weight; the same experts, weights to
float32 rounding. Ties, NaN, shapes it does not take, and a replay from a kernel graph."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu import build
from tessera.ops.cpu import moe_routing
from tessera.ops.cpu.graph import capture
from tessera.ops.moe import scored_topk_ref
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(moe_routing._SCORED.check(None)) or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

# (experts, k, router kwargs): each model family's router as its layer calls it
ROUTERS = {
    "deepseek-v2-greedy": (64, 6, dict(scaling=1.0)),
    "deepseek-v2-groups": (16, 3, dict(groups=4, topk_group=2, group_rule="max", scaling=1.5)),
    "deepseek-v3": (256, 8, dict(sigmoid=True, groups=8, topk_group=4, renormalize=True, renorm_eps=1e-20,
                                 scaling=2.5, bias=True)),
    "glm-4.5": (128, 8, dict(sigmoid=True, renormalize=True, renorm_eps=1e-20, scaling=1.0, bias=True)),
    "mistral-4": (128, 4, dict(groups=8, topk_group=3, renormalize=True, renorm_eps=1e-20, scaling=1.0)),
    "ernie-4.5": (64, 6, dict(bias=True, renormalize=True, renorm_floor=1e-12)),
    "lfm2-moe": (32, 4, dict(sigmoid=True, bias=True, renormalize=True, renorm_eps=1e-6, scaling=1.2)),
}


def _args(name, gen):
    experts, k, kwargs = ROUTERS[name]
    kwargs = dict(kwargs)
    if kwargs.pop("bias", False):
        kwargs["bias"] = 0.1 * torch.randn(experts, generator=gen)
    return experts, k, kwargs


def _same_routing(got, want, rtol=1e-5):
    """The same experts for each token (in any order), with the same weights."""
    (gw, gi), (ww, wi) = got, want
    g_order, w_order = gi.argsort(dim=1), wi.argsort(dim=1)
    assert torch.equal(gi.gather(1, g_order), wi.gather(1, w_order))
    torch.testing.assert_close(gw.gather(1, g_order), ww.gather(1, w_order), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_from_logits(name, tokens, dtype):
    gen = torch.Generator().manual_seed(tokens + len(name))
    experts, k, kwargs = _args(name, gen)
    # distinct logits in each row (exact in bf16: sixteenths up to 16), so no top k has ties
    distinct = torch.stack([torch.randperm(experts + 3, generator=gen) for _ in range(tokens)]) / 16 - 4
    logits = distinct.to(dtype)[:, 1:1 + experts]  # a strided view
    _same_routing(moe_routing.scored_topk(logits, k, **kwargs), scored_topk_ref(logits, k, **kwargs))


@pytest.mark.parametrize("name", ["deepseek-v3", "glm-4.5", "ernie-4.5", "deepseek-v2-groups"])
@pytest.mark.parametrize("tokens", [1, 8, 13, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_from_hidden_rows_and_a_float32_router(name, tokens, dtype):
    """DeepSeek's and ERNIE's routers: logits = x W^T in float32, in the same call (blocks
    of 8 tokens and a remainder), or past 32 tokens through torch's GEMM first."""
    gen = torch.Generator().manual_seed(tokens * 3 + len(name))
    experts, k, kwargs = _args(name, gen)
    hidden = 200
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = 0.2 * torch.randn(experts, hidden, generator=gen)
    _same_routing(moe_routing.scored_topk(x, k, router_weight=weight, **kwargs),
                  scored_topk_ref(x, k, router_weight=weight, **kwargs), rtol=1e-4)


def test_equal_choices_take_the_lower_expert_and_nan_never_an_invalid_id():
    logits = torch.zeros(2, 8)
    logits[1, 3] = float("nan")
    weights, ids = moe_routing.scored_topk(logits, 3, sigmoid=True)
    assert ids[0].tolist() == [0, 1, 2]
    assert ((ids >= 0) & (ids < 8)).all()


def test_shapes_it_does_not_take_run_the_torch_builder():
    """k past 64 experts' worth, groups that do not divide the experts, or kept groups with
    fewer experts than k: the torch builder's own results (or its own error)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 96, generator=gen)
    for k, kwargs in ((65, {}), (4, dict(groups=5)), (8, dict(groups=32, topk_group=2))):
        try:
            want = scored_topk_ref(logits, k, **kwargs)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                moe_routing.scored_topk(logits, k, **kwargs)
            continue
        got = moe_routing.scored_topk(logits, k, **kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_registry_picks_the_kernel():
    for dtype in (torch.bfloat16, torch.float32):
        assert select_op(OpSpec("moe_scored_routing", "cpu", dtype)).builder.name == "cpu_scored_topk"


@torch.inference_mode()
def test_a_routing_step_replays_from_a_kernel_graph():
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen)
    bias = 0.1 * torch.randn(32, generator=gen)
    kwargs = dict(sigmoid=True, bias=bias, groups=4, topk_group=2, renormalize=True, renorm_eps=1e-20, scaling=2.0,
                  router_weight=weight)
    with capture() as graph:
        weights, ids = moe_routing.scored_topk(x, 4, **kwargs)
    assert graph.replayable, graph.refused
    x.copy_(torch.randn(3, 64, generator=gen).bfloat16())
    graph.replay()
    want = moe_routing.scored_topk(x, 4, **kwargs)
    assert torch.equal(ids, want[1]) and torch.equal(weights, want[0])


def test_the_isa_setting_picks_the_build():
    want = "moe_router_avx2.c" if build.missing_cpu_flags() else "moe_router.c"
    assert moe_routing._SCORED.runnable_source() == want
