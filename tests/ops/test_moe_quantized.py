"""Expert stacks in the dense layers' formats: int8 / int4 under --quantization (ops/
moe_quantized.py), and the CPU kernels' packed layouts (ops/cpu/moe_experts.py).

Each builder against grouped_experts_ref on the values it holds (the dequantized stacks),
at a decode's rows and a prefill's; the stacks' preparation; which builder a target gets;
and a tiny Qwen3-MoE under each quantization against transformers on the same values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.ops.linear_int4 import dequantize_int4, quantize_int4
from tessera.ops.linear_int8 import dequantize_int8_groups, quantize_int8, quantize_int8_groups
from tessera.ops.cpu import linear_int4 as cpu_int4
from tessera.ops.cpu import linear_int8 as cpu_int8
from tessera.ops.moe import (ExpertLinear, expert_quantization, grouped_experts_ref, run_grouped, softmax_topk_ref,
                             stacked)
from tessera.ops.registry import OpSpec, OpTarget, builders, select_op
from tests.ops.kernel_builds import int8_rows

H, I, E, K = 64, 96, 8, 2


def int8_values(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(w)
    return q.float() * scale.unsqueeze(1)


def int8_grouped_values(w: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's int8 (a step per 32 in-features)."""
    return dequantize_int8_groups(*quantize_int8_groups(w))


def int4_values(w: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(w))


# builder -> (what each expert's matrix holds once prepared, the input dtype it serves)
BUILDERS = {
    "torch_int8_experts": (int8_values, torch.float32),
    "torch_int4_experts": (int4_values, torch.float32),
    "cpu_packed_experts": (lambda w: w.float(), torch.bfloat16),
    "cpu_packed_experts_avx2": (lambda w: w.float(), torch.bfloat16),
    "cpu_int8_experts": (int8_grouped_values, torch.bfloat16),
    "cpu_int4_experts": (int4_values, torch.bfloat16),
}


def builder_named(name: str):
    return next(b for b in builders("moe_experts") if b.name == name)


def held(stack: torch.Tensor, values) -> torch.Tensor:
    return torch.stack([values(w) for w in stack]).double()


def kernel_projection(name: str, stack: torch.Tensor, values) -> ExpertLinear:
    """One expert's projection with the values its builder holds, in double; where the CPU
    int8 / int4 kernel rounds an expert's rows of x to 8 bits (decode batches on AVX512-VNNI:
    rounds_x_to_8_bits), on x so rounded."""
    module = {"cpu_int8_experts": cpu_int8, "cpu_int4_experts": cpu_int4}.get(name)
    weights = held(stack, values)

    def project(rows: torch.Tensor, expert: int, bias: torch.Tensor | None) -> torch.Tensor:
        if module is not None and module.rounds_x_to_8_bits(rows.shape[0]):
            rows = int8_rows(rows.bfloat16())  # the kernel's x: bf16 rows, then 8 bits a group
        return F.linear(rows, weights[expert], bias)
    return project


def random_stack(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Weights ~0.1 with 2% of them 8x larger: outliers widen a quantization step, as in
    real checkpoints, so holding int8 values differs clearly from holding bf16 ones."""
    return torch.randn(shape, generator=g) * 0.1 * (1 + 7 * (torch.rand(shape, generator=g) < 0.02))


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_builder_equals_the_reference_on_the_values_it_holds(name, tokens):
    """1 token: a decode's row per expert; 64: ~16 rows each (AMX tiles where the CPU has
    them); biases and Gemma's gated GELU in the 5-token case."""
    builder = builder_named(name)
    values, dtype = BUILDERS[name]
    spec = OpSpec("moe_experts", "cpu", dtype, quant=builder.quant[0])
    if builder.rejections(spec):
        pytest.skip(f"{name} cannot run here: {builder.rejections(spec)}")
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    w13, w2 = random_stack((E, 2 * I, H), g).to(dtype), random_stack((E, H, I), g).to(dtype)
    weights, ids = softmax_topk_ref(torch.randn(tokens, E, generator=g), K, True)
    with_extras = tokens == 5
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(dtype) if with_extras else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).to(dtype) if with_extras else None
    activation = gelu_and_mul if with_extras else None

    p13, p2 = builder.prepare(w13), builder.prepare(w2)
    assert p13.shape[0] == E and (p13.dtype != dtype or p13.dim() == 4)  # really re-laid out
    got = builder.impl(x, p13, p2, weights, ids, b13, b2, activation)
    assert got.dtype == dtype and got.shape == x.shape
    expected = run_grouped(x.double(), weights.double(), ids, E, kernel_projection(name, w13, values),
                           kernel_projection(name, w2, values), None if b13 is None else b13.double(),
                           None if b2 is None else b2.double(), activation)
    # bf16: x, the hidden rows and each projection's output are rounded to bf16 (and the int
    # kernels' narrow paths round x further): 0.3-0.6% of the output's norm here, where
    # holding the wrong values (bf16 for int8, int8 for bf16) misses by 1.8% or more
    error = ((got.double() - expected).norm() / expected.norm()).item()
    assert error <= (1e-6 if dtype == torch.float32 else 0.01), error


@pytest.mark.parametrize("int4, int8", [("torch_int4_experts", "torch_int8_experts"),
                                        ("cpu_int4_experts", "cpu_int8_experts")])
def test_an_int4_builder_runs_a_down_stack_kept_in_int8(int4, int8):
    """A K-quant mix's Q6_K ffn_down_exps under int4: the down stack takes int8's layout
    (ExpertStacks._prepare_wider), and the int4 builder runs it through int8's linear."""
    builder, wide = builder_named(int4), builder_named(int8)
    values13, dtype = BUILDERS[int4]
    values2 = BUILDERS[int8][0]
    for b in (builder, wide):
        if b.rejections(OpSpec("moe_experts", "cpu", dtype, quant=b.quant[0])):
            pytest.skip(f"{b.name} cannot run here")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, H, generator=g).to(dtype)
    w13, w2 = random_stack((E, 2 * I, H), g).to(dtype), random_stack((E, H, I), g).to(dtype)
    weights, ids = softmax_topk_ref(torch.randn(5, E, generator=g), K, True)
    p13, p2 = builder.prepare(w13), wide.prepare(w2)
    assert p2.dtype == torch.int8 and p13.dtype == torch.uint8
    got = builder.impl(x, p13, p2, weights, ids)
    expected = grouped_experts_ref(x.double(), held(w13, values13), held(w2, values2), weights.double(), ids)
    error = ((got.double() - expected).norm() / expected.norm()).item()
    assert error <= (1e-6 if dtype == torch.float32 else 0.01), error


def test_stacked_prepares_each_expert_or_leaves_the_stack():
    stack = torch.randn(3, 16, 64)
    int8 = builder_named("torch_int8_experts").prepare(stack)
    assert int8.dtype == torch.int8 and int8.shape == (3, 16, 68)
    assert builder_named("torch_int8_experts").prepare(int8) is int8  # prepared already
    assert stacked(lambda w: w)(stack) is stack                       # a layout that does not change
    # one expert beyond float16's range does not take int4: the whole stack stays as loaded
    odd = stack.clone()
    odd[2, 0, 0] = 1e6
    assert builder_named("torch_int4_experts").prepare(odd) is odd
    assert builder_named("torch_int4_experts").prepare(stack).dtype == torch.uint8


def test_targets_get_their_builders():
    import importlib.util

    from tessera.ops.cpu.linear import kernel_unavailable

    from tessera.ops.cpu.build import unavailable_reason

    avx2 = unavailable_reason("gemm_bf16_avx2.c") is None
    assert select_op(OpSpec("moe_experts", "cpu", torch.bfloat16)).builder.name == (
        "cpu_packed_experts" if kernel_unavailable() is None else "cpu_packed_experts_avx2" if avx2
        else "torch_grouped_experts")
    for quant in ("int8", "int4"):
        assert select_op(OpSpec("moe_experts", "cpu", torch.float32, quant=quant)).builder.name == f"torch_{quant}_experts"
        cuda = select_op(OpSpec("moe_experts", "cuda", torch.bfloat16, quant=quant)).builder.name
        assert cuda == (f"triton_{quant}_experts" if importlib.util.find_spec("triton") else f"torch_{quant}_experts")
        assert expert_quantization(OpTarget("cpu", torch.bfloat16, quant=quant)) == quant
    assert expert_quantization(OpTarget("cpu", torch.bfloat16)) is None


TINY_QWEN3_MOE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=96, norm_topk_prob=True)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE)).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router: decisive, varied choices
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(folder)
    return folder, model


def hf_on_held_values(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """A copy of transformers' model holding what tessera holds under `quant`: every matrix
    but the embedding quantized and back (int4: the LM head in int8), experts one by one."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed_tokens" in name:
                continue
            values = int8_values if quant == "int8" or name == "lm_head.weight" else int4_values
            p.copy_(held(p.data, values) if p.dim() == 3 else values(p.data))
    return model


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_tiny_qwen3_moe_quantized_equals_transformers_on_the_same_values(tiny_qwen3_moe, quant):
    """float32 (the reference builders; every matrix takes the format): the logprobs of
    transformers on the dequantized weights; bf16 (the CPU kernels): the same greedy tokens
    as tessera's float32 run and logprobs within bf16's rounding of them."""
    from tessera.llm import LLM
    from tessera.sampling.params import SamplingParams

    folder, hf = tiny_qwen3_moe
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = torch.log_softmax(hf_on_held_values(hf, quant)(torch.tensor([prompt])).logits[0, -1].double(), -1)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(folder, dtype=dtype, quantization=quant, num_kv_blocks=32, show_progress=False) as llm:
            experts = llm.engine.model.model.layers[0].mlp.experts
            assert experts.quant == quant
            assert experts.w13_weight.dtype == (torch.int8 if quant == "int8" else torch.uint8)
            assert experts.w2_weight.dtype == experts.w13_weight.dtype
            runs[dtype] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    first = runs["float32"]
    assert first.token_ids[0] == int(reference.argmax())
    for token_id, logprob in first.logprobs[0].items():
        assert abs(logprob.logprob - reference[token_id].item()) <= 1e-4, token_id
    assert runs["bfloat16"].token_ids[:3] == first.token_ids[:3]  # (prompts keep exact x)
    for token_id, logprob in runs["bfloat16"].logprobs[0].items():
        assert abs(logprob.logprob - reference[token_id].item()) <= 0.1, token_id


def test_expert_stacks_the_format_does_not_take_are_named_at_load(tmp_path, tiny_tokenizer_dir, caplog):
    """Experts 48 wide: their down projections (48 in features) cannot take int4's groups of
    32, their gate and up projections can; the load says which stayed in bf16."""
    import logging

    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tessera.llm import LLM

    Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, "moe_intermediate_size": 48})).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(tmp_path)
    caplog.set_level(logging.WARNING, logger="tessera.engine.model_loading")
    with LLM(tmp_path, dtype="bfloat16", quantization="int4", num_kv_blocks=16, show_progress=False) as llm:
        experts = llm.engine.model.model.layers[1].mlp.experts
        assert experts.w13_weight.dtype == torch.uint8 and experts.w2_weight.dtype == torch.bfloat16
    notes = [r.getMessage() for r in caplog.records if "expert stacks" in r.getMessage()]
    assert notes == ["--quantization int4: 2 of 4 MoE expert stacks keep their torch.bfloat16 weights"]
