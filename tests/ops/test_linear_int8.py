"""Int8 weight-only linear layers (`--quantization int8`).

- quantization: per-row symmetric (the reference builder's) and in groups of 32 (the CPU
  kernel's, as GGUF's Q8_0: a Q8_0 matrix gives back its codes), error at most half a step,
  zero rows and groups safe;
- the reference builder and the kernel (AVX512 build, or its AVX2 twin on CPUs without
  AVX512) against the exact product with the dequantized weight (the kernel also quantizes
  each activation row to 15 bits; the bound below accounts for it), packed and row
  layouts, registry choices;
- a tiny Llama served with int8 equals transformers running the dequantized weights
  (float32: the reference builder; bf16: the kernel, within bf16 noise);
- the default model: int8 weights in memory and the same greedy answer as bf16.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ConfigError, ModelConfig
from tessera.ops.cpu import linear_int8 as cpu_int8
from tessera.ops.linear_int8 import (dequantize_int8_groups, linear_int8_ref, quantize_int8, quantize_int8_groups,
                                     quantize_rows, split_rows)
from tessera.ops.registry import OpSpec, select_op
from tests.ops.kernel_builds import avx512_or_amx, int8_rows

UNAVAILABLE = "; ".join(cpu_int8.kernel_unavailable()) or None  # the AVX512 or the AVX2 build
needs_kernel = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def dequantized(w: torch.Tensor) -> torch.Tensor:
    """The reference builder's values (per-row scales)."""
    q, s = quantize_int8(w)
    return q.double() * s.double().unsqueeze(1)


def grouped(w: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's values (a step per 32 in-features)."""
    return dequantize_int8_groups(*quantize_int8_groups(w)).double()


def test_quantization_is_per_row_symmetric_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 70, generator=g) * torch.logspace(-3, 2, 40).unsqueeze(1)
    w[3] = 0.0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() <= 127
    assert (q.abs().amax(dim=1)[torch.arange(40) != 3] == 127).all()  # each row uses its range
    err = (dequantized(w) - w.double()).abs()
    assert (err <= s.double().unsqueeze(1) / 2 + 1e-12).all()
    assert (q[3] == 0).all() and torch.isfinite(s).all()
    rows = quantize_rows(w)
    assert rows.shape == (40, 74) and quantize_rows(rows) is rows
    q2, s2 = split_rows(rows)
    assert torch.equal(q2, q) and torch.equal(s2, s)


def test_grouped_quantization_is_symmetric_per_group_and_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-1, 3, 24).unsqueeze(1)
    w[:, 5] = 100 * w.abs().amax(1)  # an outlier coarsens only its own group
    w[7, 32:64] = 0.0    # a zero group
    w[9] = 0.0           # a zero row
    q, d, scale = quantize_int8_groups(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (24, 3) and q.abs().max() <= 127
    assert scale.dtype == torch.float32 and torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of 2
    steps = w.view(24, 3, 32).abs().amax(2) / 127
    assert torch.equal(d.float(), (steps / scale.unsqueeze(1)).half().float())
    assert (d.float().amax(1)[torch.arange(24) != 9] >= 0.5).all() and (d.float() < 1).all()  # (0.5, 1) at the top
    step = d.float() * scale.unsqueeze(1)
    err = (dequantize_int8_groups(q, d, scale) - w).abs().view(24, 3, 32)
    assert (err <= step.unsqueeze(2) / 2 * (1 + 1e-6)).all()
    assert (q[7, 32:64] == 0).all() and d[7, 1] == 0 and (q[9] == 0).all()
    # the outlier's group has a step 100x the others' of its row
    assert (d[:, 0].float() > 50 * d[:, 1:].float().amax(1))[torch.arange(24) != 9].all()


@pytest.mark.parametrize("largest", [1e-2, 1e-4, 1e-6, 1e-8])
def test_grouped_quantization_keeps_small_weights_to_half_a_step(largest):
    """The steps are float16s relative to a power of two per row, so a matrix of tiny weights
    quantizes as finely as one of unit weights (a plain float16 step would turn subnormal below
    max |w| ~0.008, and zero below ~4e-6, taking the weights with it)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(16, 128, generator=g)
    w = w / w.abs().amax() * largest
    got = dequantize_int8_groups(*quantize_int8_groups(w))
    step = w.view(16, 4, 32).abs().amax(2, keepdim=True) / 127
    assert ((got - w).view(16, 4, 32).abs() <= step / 2 * 1.002).all()


def test_a_q8_0_matrix_gives_back_its_codes():
    """A Q8_0 tensor as the gguf package writes and reads it: from its float32 values every
    code and step comes back; from its bf16 values (what a bf16 model loads) all but a few
    codes, each of those one off."""
    import gguf
    import numpy as np

    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 256, generator=g) * torch.logspace(-2, 0, 64).unsqueeze(1)).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(64, 8, 34)
    step = torch.from_numpy(raw[..., :2].copy().view(np.float16)).squeeze(-1)
    codes = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).reshape(64, 256)
    values = (codes.float().view(64, 8, 32) * step.float().unsqueeze(2)).view(64, 256)
    q, d, scale = quantize_int8_groups(values)
    assert torch.equal(q, codes) and torch.equal(d.float() * scale.unsqueeze(1), step.float())
    q16, _, _ = quantize_int8_groups(values.bfloat16())
    off = (q16.int() - codes.int()).abs()
    assert off.max() <= 1 and off.float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_builder_equals_the_dequantized_product(dtype):
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(24, 40, generator=g), torch.randn(3, 5, 40, generator=g), torch.randn(24, generator=g)
    got = linear_int8_ref(x.to(dtype), quantize_rows(w), b.to(dtype))
    exact = F.linear(x.to(dtype).double(), dequantized(w), b.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * exact.abs().max().item()
    assert got.shape == (3, 5, 24) and (got.double() - exact).abs().max() <= tol
    with pytest.raises(ValueError, match="40"):
        linear_int8_ref(torch.randn(2, 41), quantize_rows(w), None)


@pytest.fixture(params=["avx512", "amx"])
def build(request, monkeypatch):
    return avx512_or_amx(request, monkeypatch, cpu_int8)


@needs_kernel
@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 32, 33, 40, 300])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 576), (80, 1024), (32, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_dequantized_product(m, n, k, bias):
    """The int16 path: row tiles of 6 (AVX2: 3 rows by both panels up to 3 rows) and their
    remainders, one group (k = 32) to 64; on AVX512-VNNI from 4 to 32 rows the 8-bit x path
    (6-row tiles); from the widening threshold (AVX512 only) the widened-bf16 path: 12-row
    tiles and their remainders (300 rows); odd panel counts (80) in all."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_int8.pack_int8(w)
    assert packed.dtype == torch.int8 and packed.shape == (n // 16, 64 + 17 * k)
    for got, want in zip(cpu_int8.unpack_int8(packed, k), quantize_int8_groups(w)):
        assert torch.equal(got, want)
    got = cpu_int8.gemm_int8_linear(x, packed, b).double()
    exact, tol = product_bound(x, w, b)
    assert ((got - exact).abs() <= tol).all(), (got - exact).abs().max()


def product_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x times the kernel's values of w, exactly; how far the kernel may be from it): the
    int16 path rounds x to 15 bits a row, the widened path each d * q to bf16; the 8-bit x
    path is exact on x as it rounds it (int8_rows) but for float32 sums and bf16 output."""
    wd = grouped(w)
    if cpu_int8.rounds_x_to_8_bits(x.shape[0]):
        exact = F.linear(int8_rows(x), wd, None if b is None else b.double())
        return exact, exact.abs() * 2.0 ** -7 + F.linear(x.double().abs(), wd.abs()) * 2.0 ** -16 + 1e-6
    exact = F.linear(x.double(), wd, None if b is None else b.double())
    x_step = x.double().abs().amax(dim=1, keepdim=True) / 16383 / 2
    w_round = F.linear(x.double().abs(), wd.abs()) * 2.0 ** -8
    return exact, exact.abs() * 2.0 ** -7 + x_step * wd.abs().sum(dim=1) + w_round + 1e-6


@needs_kernel
def test_kernel_builder_keeps_what_the_panels_do_not_fit_in_bf16_and_checks_inputs():
    g = torch.Generator().manual_seed(2)
    for kept in (torch.randn(40, 64, generator=g).bfloat16(),           # 40 features: no 16-panels
                 torch.randn(32, 48, generator=g).bfloat16()):          # 48 in features: no groups
        assert cpu_int8.pack_int8(kept) is kept
        xk = torch.randn(3, kept.shape[1], generator=g).bfloat16()
        want = F.linear(xk.float(), kept.float())
        torch.testing.assert_close(cpu_int8.gemm_int8_linear(xk, kept, None).float(), want,
                                   rtol=2e-2, atol=2e-2 * want.abs().max().item())
    x = torch.randn(3, 64, generator=g).bfloat16()
    rows = quantize_rows(torch.randn(40, 64, generator=g).bfloat16())  # the reference's layout still runs
    torch.testing.assert_close(cpu_int8.gemm_int8_linear(x, rows, None), linear_int8_ref(x, rows, None))
    packed = cpu_int8.pack_int8(torch.randn(32, 64, generator=g).bfloat16())
    assert cpu_int8.pack_int8(packed) is packed
    assert cpu_int8.gemm_int8_linear(x[:0], packed, None).shape == (0, 32)
    with pytest.raises(ValueError, match="expects 64"):
        cpu_int8.gemm_int8_linear(torch.randn(2, 32).bfloat16(), packed, None)


def test_registry_routes_int8_specs_to_int8_builders_only():
    bf16_int8 = select_op(OpSpec("linear", "cpu", torch.bfloat16, quant="int8"))
    assert bf16_int8.builder.name == ("torch_linear_int8" if UNAVAILABLE else "cpu_gemm_int8")
    fp32_int8 = select_op(OpSpec("linear", "cpu", torch.float32, quant="int8"))
    assert fp32_int8.builder.name == "torch_linear_int8"
    assert ("torch_linear", ("quantization int8 not supported",)) in fp32_int8.rejected
    import importlib.util
    cuda = select_op(OpSpec("linear", "cuda", torch.bfloat16, quant="int8")).builder.name
    assert cuda == ("triton_int8_linear" if importlib.util.find_spec("triton") else "torch_linear_int8")
    assert select_op(OpSpec("linear", "cpu", torch.float32)).builder.name == "torch_linear"
    with pytest.raises(ConfigError, match="quantization"):
        ModelConfig(quantization="nf4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_int8_equals_transformers_on_dequantized_weights(make_tiny_llama, dtype):
    from tessera.llm import LLM
    from tessera.sampling.params import SamplingParams

    folder, hf = make_tiny_llama(seed=5, hidden_size=64, intermediate_size=160)
    # what int8 holds: every linear weight, LM head included, per row (float32: the reference
    # builder) or in groups of 32 (bf16: the kernel, where it runs; every shape here fits it)
    held = grouped if dtype == "bfloat16" and UNAVAILABLE is None else dequantized
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(held(module.weight.data.to(getattr(torch, dtype)).float()))
    prompt = torch.randint(3, 400, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)
    with LLM(folder, dtype=dtype, quantization="int8", num_kv_blocks=32, show_progress=False) as llm:
        layer = llm.engine.model.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.int8
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == int(reference.argmax())
    top = out.logprobs[0]
    tol = 1e-4 if dtype == "float32" else 0.1
    for token_id, logprob in top.items():
        value = logprob.logprob if hasattr(logprob, "logprob") else logprob
        assert abs(value - reference[token_id].item()) <= tol, (token_id, value, reference[token_id].item())


def test_default_model_int8_holds_int8_weights_and_answers_like_bf16(default_gguf):
    """A prompt whose greedy tokens each lead by more than a nat in float32 (the chat question
    "What is the capital of France?" is no test of a weight format: float32 puts its first two
    candidates 0.08 apart, and either of "The capital..." or "L'Étoile..." is the model's)."""
    from tessera.llm import LLM
    from tessera.sampling.params import SamplingParams

    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    answers = {}
    for quantization in ("none", "int8"):
        with LLM(dtype="bfloat16", quantization=quantization, num_kv_blocks=64, show_progress=False) as llm:
            weights = [p for n, p in llm.engine.model.named_parameters() if "proj" in n]
            assert all((p.dtype == torch.int8) == (quantization == "int8") for p in weights)
            answers[quantization] = llm.generate(["The capital of France is"], params)[0].outputs[0].text
    assert answers["none"].startswith(" Paris.") and answers["int8"] == answers["none"]


def test_the_transformers_fallback_refuses_quantization(make_tiny_llama):
    from tessera.models.registry import get_router
    from tessera.models.transformers_fallback.router import FallbackUnsupportedError

    folder, _ = make_tiny_llama(seed=6)
    from tessera.ops.registry import OpTarget

    router = get_router(ModelConfig(model=str(folder), model_impl="transformers", quantization="int8"))
    with pytest.raises(FallbackUnsupportedError, match="native model folder"):
        router.build_model(OpTarget("cpu", torch.float32, quant="int8"))


@needs_kernel
@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("m", [1100, 30])
def test_kernel_across_row_blocks(m):
    """More rows than one block of x: the AVX512 widened path's 4 MB (1024 rows at
    k = 2048), the int16 path's 96 KB (24 rows); the 8-bit path's 96 KB (48 rows) at k =
    4096."""
    g = torch.Generator().manual_seed(10)
    k = 2048 if m > 1000 else 4096
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(48, k, generator=g).bfloat16()
    got = cpu_int8.gemm_int8_linear(x, cpu_int8.pack_int8(w), None).double()
    exact, tol = product_bound(x, w, None)
    assert ((got - exact).abs() <= tol).all()
