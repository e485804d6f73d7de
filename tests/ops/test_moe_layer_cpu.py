"""A mixture-of-experts layer in two C calls on CPU (moe_layer.c): softmax top-k routing
(ops/cpu/moe_routing.py) against torch's, ties and NaN included, and the one-call experts
(ops/cpu/moe_experts.py) against the per-expert loop they replace, for every CPU builder's
stacks, biases, a wider int8 down stack beside int4, and bad expert ids; both are recorded
by a kernel graph and replay new inputs as an eager call computes them."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu.graph import capture
from tessera.ops.cpu.moe_experts import DRIVEN_MAX_TOKENS
from tessera.ops.cpu.moe_routing import _KERNEL as ROUTING_KERNEL
from tessera.ops.cpu.moe_routing import softmax_topk_bf16
from tessera.ops.moe import per_expert, softmax_topk_ref
from tessera.ops.registry import OpSpec, builders

pytestmark = pytest.mark.skipif(bool(ROUTING_KERNEL.check(None)), reason="; ".join(ROUTING_KERNEL.check(None)))

H, I, E, K = 64, 96, 8, 2
# moe_experts builder -> the linear builder its experts run through
LINEAR_OF = {"cpu_packed_experts": "cpu_gemm_bf16", "cpu_packed_experts_avx2": "cpu_gemm_bf16_avx2",
             "cpu_int8_experts": "cpu_gemm_int8", "cpu_int4_experts": "cpu_gemm_int4"}


def named(op: str, name: str):
    return next(b for b in builders(op) if b.name == name)


def runnable(name: str):
    builder = named("moe_experts", name)
    reasons = builder.rejections(OpSpec("moe_experts", "cpu", torch.bfloat16, quant=builder.quant[0]))
    if reasons:
        pytest.skip(f"{name} cannot run here: {reasons}")
    return builder


def loop_of(name: str):
    """The per-expert loop the builder ran before (ops/moe.py's run_grouped)."""
    return per_expert(named("linear", LINEAR_OF[name]).impl, "loop")


@pytest.mark.parametrize("experts, top_k", [(8, 2), (60, 4), (128, 8), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_torch(experts, top_k, renormalize):
    g = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(300, experts, generator=g) * 3).bfloat16()
    weights, ids = softmax_topk_bf16(logits, top_k, renormalize)
    expected_weights, expected_ids = softmax_topk_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    # bf16 logits tie now and then: the chosen logits must be the same, best first
    assert torch.equal(logits.gather(1, ids), logits.gather(1, expected_ids))
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_scales_each_chosen_expert_s_weight(renormalize):
    """Gemma 4's per_expert_scale: each kept weight times its expert's bf16 scale, in the
    same call; a scale of another dtype goes to torch, still right."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(40, 16, generator=g) * 3).bfloat16()
    scales = (0.5 + torch.rand(16, generator=g)).bfloat16()
    weights, ids = softmax_topk_bf16(logits, 4, renormalize, scales)
    want_weights, want_ids = softmax_topk_ref(logits, 4, renormalize, scales)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)
    plain, _ = softmax_topk_bf16(logits, 4, renormalize)
    torch.testing.assert_close(weights, plain * scales.float()[ids], rtol=0, atol=0)
    got = softmax_topk_bf16(logits, 4, renormalize, scales.float())
    assert all(torch.equal(a, b) for a, b in zip(got, softmax_topk_ref(logits, 4, renormalize, scales.float())))


def test_routing_ties_take_the_lower_expert_first_and_nan_never_escapes():
    logits = torch.zeros(2, 6).bfloat16()
    logits[1, 3] = float("nan")
    weights, ids = softmax_topk_bf16(logits, 3, True)
    assert ids[0].tolist() == [0, 1, 2]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))
    assert ids[1].min() >= 0 and ids[1].max() < 6 and len(set(ids[1].tolist())) == 3


def test_routing_outside_the_kernel_falls_back_to_torch():
    logits = torch.randn(4, 80)
    for args in ((logits, 2, True), (logits.bfloat16(), 70, True), (logits.bfloat16().t().contiguous().t(), 2, False)):
        weights, ids = softmax_topk_bf16(*args)
        expected = softmax_topk_ref(*args)
        assert torch.equal(ids, expected[1]) and torch.equal(weights, expected[0])


def stacks(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(), (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()


@pytest.mark.parametrize("tokens", [1, 3, 8, DRIVEN_MAX_TOKENS, DRIVEN_MAX_TOKENS + 1])
@pytest.mark.parametrize("name", list(LINEAR_OF))
def test_one_call_experts_equal_the_per_expert_loop(name, tokens):
    """The same kernels per expert and the same roundings: the SwiGLU in bf16 after each
    op, products with the bf16 weight rounded, each token's sum in float32 rounded once.
    (Past DRIVEN_MAX_TOKENS the builder runs that loop itself.) Biases at 3 tokens."""
    builder = runnable(name)
    g = torch.Generator().manual_seed(tokens)
    w13, w2 = stacks(g)
    p13, p2 = builder.prepare(w13), builder.prepare(w2)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(tokens, E, generator=g) * 3, K, True)
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16() if tokens == 3 else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16() if tokens == 3 else None
    got = builder.impl(x, p13, p2, weights, ids, b13, b2)
    expected = loop_of(name)(x, p13, p2, weights, ids, b13, b2)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3)
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-3


def test_an_int4_layer_runs_an_int8_down_stack_in_one_call():
    """A K-quant mix's Q6_K down stack beside int4 gate-up: each projection takes its own
    stack's kernel."""
    builder, wide = runnable("cpu_int4_experts"), runnable("cpu_int8_experts")
    g = torch.Generator().manual_seed(9)
    w13, w2 = stacks(g)
    p13, p2 = builder.prepare(w13), wide.prepare(w2)
    assert p13.dtype == torch.uint8 and p2.dtype == torch.int8
    x = torch.randn(4, H, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(4, E, generator=g) * 3, K, True)
    with capture() as graph:
        got = builder.impl(x, p13, p2, weights, ids)
    assert [kernel.symbol for kernel, _ in graph.calls] == ["tessera_moe_experts"]
    torch.testing.assert_close(got.float(), loop_of("cpu_int4_experts")(x, p13, p2, weights, ids).float(),
                               rtol=1e-2, atol=1e-3)


def test_expert_ids_out_of_range_are_refused():
    builder = runnable("cpu_packed_experts")
    g = torch.Generator().manual_seed(2)
    w13, w2 = stacks(g)
    x = torch.randn(2, H, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(2, E, generator=g), K, True)
    ids[1, 0] = E
    with pytest.raises(ValueError, match="expert id is out of range"):
        builder.impl(x, builder.prepare(w13), builder.prepare(w2), weights, ids)


@pytest.mark.parametrize("name", ["cpu_packed_experts", "cpu_int4_experts"])
def test_a_captured_layer_replays_new_inputs(name):
    """Routing and experts record one kernel call each and nothing a replay would skip; a
    replay over new hidden rows and router logits (other experts, other row counts per
    expert: the GEMM kernels chosen inside the call) equals an eager call on them."""
    builder = runnable(name)
    g = torch.Generator().manual_seed(4)
    w13, w2 = stacks(g)
    p13, p2 = builder.prepare(w13), builder.prepare(w2)
    x = torch.randn(8, H, generator=g).bfloat16()
    logits = (torch.randn(8, E, generator=g) * 3).bfloat16()
    with capture() as graph:
        out = builder.impl(x, p13, p2, *softmax_topk_bf16(logits, K, True))
    assert [kernel.symbol for kernel, _ in graph.calls] == ["tessera_moe_softmax_topk", "tessera_moe_experts"]
    assert graph.replayable, graph.refused
    for seed in range(3):
        x.copy_(torch.randn(8, H, generator=g).bfloat16())
        logits.copy_((torch.randn(8, E, generator=g) * 3).bfloat16())
        graph.replay()
        assert torch.equal(out, builder.impl(x, p13, p2, *softmax_topk_bf16(logits, K, True)))


def test_padded_rows_of_a_graph_step_run_no_experts():
    """In a step padded to a graph's rows (the step's live_rows), the padded rows get no
    experts, so their weights are never fetched (their ids here are out of range, which any
    real row would have refused) and zero rows; the real rows are as a step of them alone."""
    from tessera.ops.attention.metadata import AttentionMetadata, attention_context

    builder = runnable("cpu_int4_experts")
    g = torch.Generator().manual_seed(6)
    w13, w2 = stacks(g)
    p13, p2 = builder.prepare(w13), builder.prepare(w2)
    x = torch.randn(8, H, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(8, E, generator=g) * 3, K, True)
    ids[5:] = E
    live = torch.tensor([5])
    meta = AttentionMetadata(slot_mapping=torch.full((8,), -1), block_tables=torch.zeros(8, 1, dtype=torch.int32),
                             seq_lens=torch.ones(8, dtype=torch.int32), query_start_loc=torch.arange(9, dtype=torch.int32),
                             num_decodes=8, num_decode_tokens=8, seq_lens_list=[1] * 8, query_lens_list=[1] * 8,
                             has_padding=True, live_rows=live)
    with attention_context(meta):
        got = builder.impl(x, p13, p2, weights, ids)
    assert torch.equal(got[:5], builder.impl(x[:5], p13, p2, weights[:5], ids[:5]))
    assert not got[5:].any()
    live.fill_(8)  # read at each call: all rows real, and the bad ids are refused
    with attention_context(meta), pytest.raises(ValueError, match="out of range"):
        builder.impl(x, p13, p2, weights, ids)


def activations() -> dict:
    from tessera.ops.activation import ClampedSwiGLU, GeluTanhAndMul
    from tessera.ops.registry import OpTarget

    target = OpTarget("cpu", torch.bfloat16)
    return {"gelu": GeluTanhAndMul(target), "clamped": ClampedSwiGLU(1.702, 7.0, target)}


@pytest.mark.parametrize("activation", ["gelu", "clamped"])
def test_gemma_and_gpt_oss_activations_run_in_the_call(activation):
    """Gemma's gated GELU (its kernel) and gpt-oss's clamped SwiGLU (in C, rounding after
    each op as torch does), with biases: as the loop applies them in torch."""
    builder = runnable("cpu_packed_experts")
    act = activations()[activation]
    g = torch.Generator().manual_seed(8)
    w13, w2 = stacks(g)
    w13 = w13 * 8  # gate and up values past the clamp's limit
    p13, p2 = builder.prepare(w13), builder.prepare(w2)
    x = torch.randn(5, H, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(5, E, generator=g) * 3, K, True)
    b13, b2 = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16(), (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    with capture() as graph:
        got = builder.impl(x, p13, p2, weights, ids, b13, b2, act)
    assert [kernel.symbol for kernel, _ in graph.calls] == ["tessera_moe_experts"]
    expected = loop_of("cpu_packed_experts")(x, p13, p2, weights, ids, b13, b2, act)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-3


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", list(LINEAR_OF))
def test_gateless_relu_squared_experts_run_in_the_call(name, tokens):
    """Nemotron 3's experts: an up stack of I rows an expert (no gate), relu squared between
    (gating.h's kernel), then down: one call, as the loop computes it."""
    from tessera.ops.activation import ReluSquared
    from tessera.ops.registry import OpTarget

    builder = runnable(name)
    g = torch.Generator().manual_seed(20 + tokens)
    up, w2 = (torch.randn(E, I, H, generator=g) * 0.1).bfloat16(), (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    p13, p2 = builder.prepare(up), builder.prepare(w2)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(tokens, E, generator=g) * 3, K, True)
    act = ReluSquared(OpTarget("cpu", torch.bfloat16))
    with capture() as graph:
        got = builder.impl(x, p13, p2, weights, ids, None, None, act)
    assert [kernel.symbol for kernel, _ in graph.calls] == ["tessera_moe_experts"]
    expected = loop_of(name)(x, p13, p2, weights, ids, None, None, act)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3)
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-3


@pytest.mark.parametrize("tokens", [1, 6])
def test_mxfp4_stacks_run_in_the_call(tokens):
    """gpt-oss's experts as its checkpoint keeps them (MXFP4 blocks and scales, the bf16
    kernel's float32 sums rounded as its builder rounds them), biases and the clamped SwiGLU:
    as the per-expert loop computes them."""
    from tessera.ops.cpu import moe_mxfp4 as cpu_moe_mxfp4
    from tessera.ops.moe_mxfp4 import run_mxfp4_experts
    from tests.ops.test_moe_mxfp4 import random_stack

    if not cpu_moe_mxfp4._bf16_kernel_runs():
        pytest.skip("the MXFP4 experts' bf16 kernel does not run here (AVX2 only)")
    experts, hidden, inter = 4, 64, 96
    w13 = random_stack(experts, 2 * inter, groups=hidden // 32, seed=1)
    w2 = random_stack(experts, hidden, groups=inter // 32, seed=2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    weights, ids = softmax_topk_ref(torch.randn(tokens, experts, generator=g) * 3, 2, True)
    b13 = torch.randn(experts, 2 * inter, generator=g).bfloat16()
    b2 = torch.randn(experts, hidden, generator=g).bfloat16()
    act = activations()["clamped"]
    with capture() as graph:
        got = cpu_moe_mxfp4.mxfp4_experts_cpu(x, w13, w2, weights, ids, b13, b2, act)
    assert [kernel.symbol for kernel, _ in graph.calls] == ["tessera_moe_experts"]
    expected = run_mxfp4_experts(cpu_moe_mxfp4.mxfp4_linear, x, w13, w2, weights, ids, b13, b2, act)
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-3
