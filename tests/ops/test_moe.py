"""The MoE ops: softmax top-k routing as transformers' Mixtral / Qwen3-MoE routers do it,
the expert compute grouped by expert against a naive per-token loop, and the stacked
expert weight loader."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.ops.moe import (HF_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES, SparseMoE,
                             expert_weight_target, grouped_experts_ref, softmax_topk_ref)
from tessera.ops.registry import OpSpec, OpTarget, select_op

T, H, I, E, K = 37, 16, 24, 6, 2


def naive_moe(x, w13, w2, weights, ids):
    """One token at a time, one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_case(seed: int, num_experts: int = E, tokens: int = T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(num_experts, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(num_experts, H, I, generator=g) * 0.2
    logits = torch.randn(tokens, num_experts, generator=g)
    return x, w13, w2, logits


@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_experts_match_a_per_token_loop(renormalize):
    x, w13, w2, logits = random_case(0)
    weights, ids = softmax_topk_ref(logits, K, renormalize)
    torch.testing.assert_close(grouped_experts_ref(x, w13, w2, weights, ids),
                               naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_unused_experts_and_a_single_token():
    # 8 experts, 1 token: six experts get no rows and are skipped
    x, w13, w2, logits = random_case(1, num_experts=8, tokens=1)
    weights, ids = softmax_topk_ref(logits, K, True)
    torch.testing.assert_close(grouped_experts_ref(x, w13, w2, weights, ids),
                               naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_routing_matches_the_definitions():
    logits = torch.randn(9, E)
    probs = logits.softmax(-1)
    weights, ids = softmax_topk_ref(logits, 3, renormalize=False)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (ids == probs.argsort(-1, descending=True)[:, :3]).all()
    renorm, ids2 = softmax_topk_ref(logits, 3, renormalize=True)
    assert (ids2 == ids).all()
    torch.testing.assert_close(renorm, weights / weights.sum(-1, keepdim=True))
    torch.testing.assert_close(renorm.sum(-1), torch.ones(9))


def test_bfloat16_inputs_keep_float32_routing_and_input_dtype_output():
    x, w13, w2, logits = random_case(2)
    weights, ids = softmax_topk_ref(logits.bfloat16(), K, True)
    assert weights.dtype == torch.float32
    out = grouped_experts_ref(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive_moe(x, w13, w2, weights, ids), atol=0.05, rtol=0.05)


def test_reference_builders_are_registered():
    for kind, name in (("moe_routing", "torch_softmax_topk"), ("moe_experts", "torch_grouped_experts")):
        assert select_op(OpSpec(kind, "cpu", torch.float32)).builder.name == name


def test_expert_names_map_to_stacked_shards():
    assert expert_weight_target("model.layers.3.mlp.experts.5.w3.weight", MIXTRAL_EXPERT_NAMES) == (
        "model.layers.3.mlp.experts.w13_weight", (5, 1))
    assert expert_weight_target("model.layers.0.mlp.experts.12.down_proj.weight", HF_EXPERT_NAMES) == (
        "model.layers.0.mlp.experts.w2_weight", (12, 0))
    assert expert_weight_target("model.layers.0.mlp.experts.gate_up_proj", HF_EXPERT_NAMES) == (
        "model.layers.0.mlp.experts.w13_weight", None)
    assert expert_weight_target("model.layers.0.mlp.gate_proj.weight", HF_EXPERT_NAMES) is None
    assert expert_weight_target("model.layers.0.mlp.experts.1.w1.weight", HF_EXPERT_NAMES) is None


def test_layer_loads_per_expert_tensors_into_stacked_rows():
    x, w13, w2, logits = random_case(3)
    moe = SparseMoE(H, I, E, K, renormalize=True, target=OpTarget("cpu", torch.float32))
    p13, p2 = moe.experts.w13_weight, moe.experts.w2_weight
    for e in range(E):
        p13.weight_loader(p13, w13[e, :I], (e, 0))
        p13.weight_loader(p13, w13[e, I:], (e, 1))
        p2.weight_loader(p2, w2[e], (e, 0))
    gate = torch.randn(E, H)
    moe.gate.weight.weight_loader(moe.gate.weight, gate)
    assert torch.equal(p13, w13) and torch.equal(p2, w2)
    weights, ids = softmax_topk_ref(x @ gate.T, K, True)
    torch.testing.assert_close(moe(x), naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(KeyError, match="out of range"):
        p2.weight_loader(p2, w2[0], (E, 0))
    with pytest.raises(ValueError, match="checkpoint shape"):
        p13.weight_loader(p13, w13[0], (0, 0))
