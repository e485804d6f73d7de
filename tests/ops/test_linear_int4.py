"""Int4 weight-only linear layers (`--quantization int4`).

- quantization: groups of 32, codes 0..15, error at most half a step, flat groups exact;
- the row layout and the kernel's panels both hold exactly quantize_int4's parts;
- the reference builder and the kernel (AVX512) against the exact product with the
  dequantized weight: the int16 path (the kernel quantizes each activation row to 15 bits;
  the bound accounts for it) and, from the widening threshold, the bf16-dequantized path;
- what the format or the panels do not fit (out features not a multiple of 16, in features
  not a multiple of 32, values beyond float16) stays in bf16; mismatched inputs refused;
- a tiny Llama served with int4 equals transformers running the dequantized weights, with
  the LM head in int8;
- the default model: int4 weights in memory, the same greedy answer as bf16.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tessera.ops.cpu import linear_int4 as cpu_int4
from tessera.ops.linear_int4 import (GROUP, dequantize_int4, linear_int4_ref, lm_head_quantization, pack_int4_rows,
                                     quantize_int4, unpack_int4_rows)
from tessera.ops.cpu import linear_int8 as cpu_int8
from tessera.ops.linear_int8 import dequantize_int8_groups, quantize_int8, quantize_int8_groups
from tessera.ops.registry import OpSpec, select_op
from tests.ops.kernel_builds import avx512_or_amx, int8_rows, step_metadata

UNAVAILABLE = "; ".join(cpu_int4.kernel_unavailable()) or None  # the AVX512 or the AVX2 build
needs_kernel = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def dequantized(w: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(w)).double()


def test_quantization_is_per_group_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 2, 40).unsqueeze(1)
    w[3] = 0.0
    w[5, 32:64] = 1.5  # a flat group
    codes, d, m = quantize_int4(w)
    assert codes.dtype == torch.uint8 and codes.max() <= 15 and d.dtype == m.dtype == torch.float16
    assert d.shape == m.shape == (40, 3)
    err = (dequantized(w) - w.double()).abs().view(40, 3, GROUP)
    step = d.double().unsqueeze(2)
    assert (err <= step * 0.51 + 1e-7).all()  # half a step, and the float16 step's rounding
    assert (codes.view(40, 3, GROUP).amax(2)[d > 0] == 15).all()  # each group uses its range
    assert (codes[3] == 0).all() and (d[3] == 0).all() and (m[3] == 0).all()
    assert d[5, 1] == 0 and m[5, 1] == 1.5 and (dequantized(w)[5, 32:64] == 1.5).all()


def test_row_layout_round_trip():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    rows = pack_int4_rows(w)
    assert rows.dtype == torch.uint8 and rows.shape == (24, 40) and pack_int4_rows(rows) is rows
    for got, want in zip(unpack_int4_rows(rows, 64), quantize_int4(w)):
        assert torch.equal(got, want)
    unquantizable = torch.randn(8, 40)
    assert pack_int4_rows(unquantizable) is unquantizable  # 40 is not a multiple of 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_builder_equals_the_dequantized_product(dtype):
    g = torch.Generator().manual_seed(2)
    w, x, b = torch.randn(24, 64, generator=g), torch.randn(3, 5, 64, generator=g), torch.randn(24, generator=g)
    got = linear_int4_ref(x.to(dtype), pack_int4_rows(w), b.to(dtype))
    exact = F.linear(x.to(dtype).double(), dequantized(w), b.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * exact.abs().max().item()
    assert got.shape == (3, 5, 24) and (got.double() - exact).abs().max() <= tol
    with pytest.raises(ValueError, match="expects 64"):
        linear_int4_ref(torch.randn(2, 96), pack_int4_rows(w), None)
    kept = torch.randn(8, 40, generator=g)  # not quantizable: the float weight serves as is
    xk = torch.randn(2, 40, generator=g)
    torch.testing.assert_close(linear_int4_ref(xk, pack_int4_rows(kept), None), F.linear(xk, kept))


@pytest.fixture(params=["avx512", "amx"])
def build(request, monkeypatch):
    return avx512_or_amx(request, monkeypatch, cpu_int4)


@needs_kernel
@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 32, 33, 40, 300, 600])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 576), (80, 1024), (32, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_dequantized_product(m, n, k, bias):
    """Row tiles of 4 and their remainders (AVX2: 2 rows by both panels up to 2 rows); from 4
    to 32 rows (on AMX to 8) the 8-bit x path's 6-row tiles and their remainders (AVX2: 4
    rows by one panel); from 33 rows (64 without AVX512-BF16, 9 on AMX; AVX512 only) the
    dequantized bf16 path with 12-row tiles and their remainders (300 rows; on AMX 600 rows
    are two blocks of x); odd panel counts (80); one group (k = 32) and 64 groups."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_int4.pack_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (n // 16, 10 * k)
    for got, want in zip(cpu_int4.unpack_int4(packed, k), quantize_int4(w)):
        assert torch.equal(got, want)
    got = cpu_int4.gemm_int4_linear(x, packed, b).double()
    wd = dequantized(w)
    if cpu_int4.rounds_x_to_8_bits(m):  # exact on x as it rounds it
        exact = F.linear(int8_rows(x), wd, None if b is None else b.double())
        tol = exact.abs() * 2.0 ** -7 + F.linear(x.double().abs(), wd.abs()) * 2.0 ** -16 + 1e-6
        assert ((got - exact).abs() <= tol).all(), (got - exact).abs().max()
        return
    exact = F.linear(x.double(), wd, None if b is None else b.double())
    x_step = x.double().abs().amax(dim=1, keepdim=True) / 16383 / 2   # the int16 path's rounding of x
    w_round = F.linear(x.double().abs(), wd.abs()) * 2.0 ** -8        # the bf16 path's rounding of w
    tol = exact.abs() * 2.0 ** -7 + x_step * wd.abs().sum(dim=1) + w_round + 1e-6
    assert ((got - exact).abs() <= tol).all(), (got - exact).abs().max()


@needs_kernel
@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("module", ["int4", "int8"])
def test_only_decode_steps_round_x_to_8_bits(module):
    """8 rows as one prompt's (or a prompt and a draft's: not one token per sequence) are
    multiplied as they are; the same 8 rows as 8 sequences' decode rows take 8-bit x where the
    build has it (int4: every build; int8: AVX512-VNNI), so prompts answer as they did before."""
    from tessera.ops.attention.metadata import attention_context

    kernels = cpu_int4 if module == "int4" else cpu_int8
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 576, generator=g).bfloat16()
    x = (torch.randn(8, 576, generator=g) * torch.logspace(-2, 1, 576)[torch.randperm(576, generator=g)]).bfloat16()
    if module == "int4":
        packed, wd, op = cpu_int4.pack_int4(w), dequantized(w), cpu_int4.gemm_int4_linear
    else:
        packed, op = cpu_int8.pack_int8(w), cpu_int8.gemm_int8_linear
        wd = dequantize_int8_groups(*quantize_int8_groups(w)).double()
    exact, rounded = F.linear(x.double(), wd), F.linear(int8_rows(x), wd)
    out_round = exact.abs() * 2.0 ** -7 + 1e-6  # bf16 output
    for lens in ([8], [1, 7], [1] * 7 + [2], "view"):
        # "view": a prompt step inside which a model runs some rows as decodes (Gemma 4)
        with attention_context(step_metadata([8] if lens == "view" else lens)), \
                attention_context(step_metadata([1] * 8)) if lens == "view" else contextlib.nullcontext():
            assert not kernels.rounds_x_to_8_bits(8)
            got = op(x, packed, None).double()
        x_step = x.double().abs().amax(dim=1, keepdim=True) / 16383 / 2  # 15-bit x, or bf16 w
        assert ((got - exact).abs() <= out_round + x_step * wd.abs().sum(1) + F.linear(
            x.double().abs(), wd.abs()) * 2.0 ** -8).all(), lens
        assert (got - exact).norm() < 0.5 * (got - rounded).norm(), lens  # x's product, not 8-bit x's
    with attention_context(step_metadata([1] * 8)):
        eight_bit = kernels.rounds_x_to_8_bits(8)
        got = op(x, packed, None).double()
    if eight_bit:
        assert ((got - rounded).abs() <= out_round + F.linear(x.double().abs(), wd.abs()) * 2.0 ** -16).all()
        assert (got - rounded).norm() < 0.5 * (got - exact).norm()


@needs_kernel
def test_kernel_builder_keeps_what_the_panels_do_not_fit_in_bf16_and_checks_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g).bfloat16()
    for kept in (torch.randn(40, 64, generator=g).bfloat16(),   # 40 out features: no panels
                 torch.randn(32, 48, generator=g).bfloat16(),   # 48 in features: no groups
                 torch.randn(32, 64, generator=g).bfloat16() * torch.tensor([1.0] * 63 + [7e4]).bfloat16()):
        assert cpu_int4.pack_int4(kept) is kept
        xk = torch.randn(2, kept.shape[1], generator=g).bfloat16()
        torch.testing.assert_close(cpu_int4.gemm_int4_linear(xk, kept, None).float(), F.linear(xk, kept).float(),
                                   rtol=2e-2, atol=2e-2 * F.linear(xk, kept).abs().max().item())
    rows = pack_int4_rows(torch.randn(40, 64, generator=g).bfloat16())  # the reference's layout still runs
    torch.testing.assert_close(cpu_int4.gemm_int4_linear(x, rows, None), linear_int4_ref(x, rows, None))
    packed = cpu_int4.pack_int4(torch.randn(32, 64, generator=g).bfloat16())
    assert cpu_int4.gemm_int4_linear(x[:0], packed, None).shape == (0, 32)
    assert cpu_int4.gemm_int4_linear(x.view(3, 1, 64), packed, None).shape == (3, 1, 32)
    with pytest.raises(ValueError, match="expects 64"):
        cpu_int4.gemm_int4_linear(torch.randn(2, 32).bfloat16(), packed, None)


def test_weights_beyond_float16_stay_in_float():
    """A group's offset is a float16: a value of 7e4 would make it inf and the row NaN."""
    w = torch.randn(16, 64)
    w[1, 5] = -7e4
    assert pack_int4_rows(w) is w
    x = torch.randn(2, 64)
    got = linear_int4_ref(x, pack_int4_rows(w), None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.linear(x, w))


def test_the_offset_rounds_down_so_the_step_is_never_negative():
    w = torch.full((2, 32), 1000.3)
    w[0, 1] = 1000.31  # float16's nearest to 1000.3 is 1000.5, above the whole group
    codes, d, m = quantize_int4(w)
    assert (d >= 0).all() and (m.float() <= w.view(2, 1, 32).amin(2)).all()
    assert (dequantize_int4(codes, d, m) - w).abs().max() <= d.float().max() / 2 + 1e-3


def test_registry_routes_int4_specs_to_int4_builders_and_the_lm_head_to_int8():
    bf16 = select_op(OpSpec("linear", "cpu", torch.bfloat16, quant="int4"))
    assert bf16.builder.name == ("torch_linear_int4" if UNAVAILABLE else "cpu_gemm_int4")
    assert select_op(OpSpec("linear", "cpu", torch.float32, quant="int4")).builder.name == "torch_linear_int4"
    import importlib.util
    cuda = select_op(OpSpec("linear", "cuda", torch.bfloat16, quant="int4")).builder.name
    assert cuda == ("triton_int4_linear" if importlib.util.find_spec("triton") else "torch_linear_int4")
    assert lm_head_quantization("int4") == "int8"
    assert lm_head_quantization("int8") == "int8" and lm_head_quantization(None) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_int4_equals_transformers_on_dequantized_weights(make_tiny_llama, dtype):
    from tessera.llm import LLM
    from tessera.sampling.params import SamplingParams

    folder, hf = make_tiny_llama(seed=5, hidden_size=64, intermediate_size=160)
    with torch.no_grad():  # what int4 holds: the layers in int4, the LM head in int8
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.data.to(getattr(torch, dtype)).float()
                if name == "lm_head" and dtype == "bfloat16" and not cpu_int8.kernel_unavailable():
                    module.weight.copy_(dequantize_int8_groups(*quantize_int8_groups(w)))  # the kernel's groups
                elif name == "lm_head":
                    q, s = quantize_int8(w)
                    module.weight.copy_(q.float() * s.unsqueeze(1))
                else:
                    module.weight.copy_(dequantized(w))
    prompt = torch.randint(3, 400, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=5)
    with LLM(folder, dtype=dtype, quantization="int4", num_kv_blocks=32, show_progress=False) as llm:
        model = llm.engine.model
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
        assert model.lm_head.weight.dtype == torch.int8
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == int(reference.argmax())
    tol = 1e-4 if dtype == "float32" else 0.1
    for token_id, logprob in out.logprobs[0].items():
        value = logprob.logprob if hasattr(logprob, "logprob") else logprob
        assert abs(value - reference[token_id].item()) <= tol, (token_id, value, reference[token_id].item())


def test_default_model_runs_its_q4_1_weights_as_stored_in_int4(default_gguf, caplog):
    """The default model's file stores its matrices as Q4_1. Without a --quantization they run
    as stored, in int4, where the CPU's int4 kernel runs (and the load says so); "none" loads
    them in bf16 (and the load names the flag that keeps them compact). Both answer alike."""
    import logging

    from tessera.llm import LLM
    from tessera.ops.cpu.linear_int4 import kernel_unavailable
    from tessera.sampling.params import SamplingParams
    from tessera.weights.gguf import gguf_matrix_format

    assert gguf_matrix_format(default_gguf) == "Q4_1"
    caplog.set_level(logging.INFO, logger="tessera.engine")

    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    answers = {}
    for quantization in (None, "none", "int4"):
        int4 = quantization == "int4" or (quantization is None and not kernel_unavailable())
        with LLM(dtype="bfloat16", quantization=quantization, num_kv_blocks=64, show_progress=False) as llm:
            assert llm.engine.quantization == ("int4" if int4 else None)
            weights = [p for n, p in llm.engine.model.named_parameters() if "proj" in n]
            assert all((p.dtype == torch.uint8) == int4 for p in weights)
            answers[quantization] = llm.chat([question], params)[0].outputs[0].text
        messages = [r.getMessage() for r in caplog.records]
        hints = [m for m in messages if "--quantization int4 keeps" in m]
        assert len(hints) == (0 if int4 else 1) and all("as Q4_1" in hint for hint in hints)
        chosen = [m for m in messages if "they run as stored, in int4" in m]
        assert len(chosen) == (1 if int4 and quantization is None else 0)
        caplog.clear()
    assert "Paris" in answers["none"] and answers["int4"] == answers["none"] == answers[None]


def test_layers_the_format_does_not_take_are_named_at_load(make_tiny_llama, caplog):
    """Hidden size 48: no projection takes int4, and the load says so."""
    import logging

    from tessera.llm import LLM

    folder, _ = make_tiny_llama(seed=9, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                                num_key_value_heads=2)
    caplog.set_level(logging.WARNING, logger="tessera.engine.model_loading")
    with LLM(folder, dtype="bfloat16", quantization="int4", num_kv_blocks=16, show_progress=False) as llm:
        layer = llm.engine.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
        assert layer.mlp.down_proj.weight.dtype == torch.uint8  # 96 in features: quantized
    notes = [r.getMessage() for r in caplog.records if "keep their" in r.getMessage()]
    assert len(notes) == 1 and "--quantization int4" in notes[0]
