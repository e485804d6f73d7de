"""Tessera's gpt-oss against transformers' GptOssForCausalLM on tiny random checkpoints:
attention sinks (drawn large enough to matter), biased Q/K/V/O, an 8-token sliding window
on alternate layers, YaRN, and a mixture of 4 experts (top-2) with a biased router, biased
experts and the clamped SwiGLU. One case has equal hidden and intermediate sizes (as the
real models do), where the stacked experts' layout cannot be told from their shapes. The
MXFP4 checkpoint format OpenAI ships is loaded, dequantized, and compared with transformers
holding the same dequantized weights. A bf16 run goes through the CPU kernels with sinks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.inspection import format_report, inspect_model
from tessera.models.gpt_oss.modeling import GptOssMoE
from tessera.ops.cpu import paged_decode
from tessera.ops.registry import selections
from tessera.weights.mxfp4 import E2M1_VALUES, dequantize_mxfp4
from tessera.weights.safetensors import iter_hf_weights

from tests.models.parity import (VOCAB, Case, check_bf16_close, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, hf_logits, make_tiny, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            initializer_range=0.1, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
CASES = {
    "gpt_oss": dict(intermediate_size=96),
    # hidden == intermediate (2880 in both real models); three layers: sliding, full, sliding
    "gpt_oss-equal-sizes": dict(intermediate_size=64, num_hidden_layers=3, swiglu_limit=0.5),
}


def _drawn_sinks_and_biases(model: torch.nn.Module, g: torch.Generator) -> None:
    """Sinks, every bias and the routers at scales where a loader that skipped them, or a
    model that ignored them, would differ."""
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.copy_(1.5 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias") or name.endswith("router.weight"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def make_tiny_gpt_oss(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Saves a random transformers GptOssForCausalLM (+ the tiny tokenizer) to `folder`;
    returns the float32 eval-mode model."""
    from transformers import GptOssConfig, GptOssForCausalLM

    return make_tiny(folder, tokenizer_dir, GptOssConfig, GptOssForCausalLM, seed=seed, base=BASE,
                     tweak=_drawn_sinks_and_biases, **overrides)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_gpt_oss(folder, tiny_tokenizer_dir, seed=len(request.param), **CASES[request.param])
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_weights_land_where_transformers_holds_them(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "GptOssForCausalLM"
    for i, (ours, theirs) in enumerate(zip(model.model.layers, case.hf.model.layers)):
        attn = ours.self_attn
        assert attn.attn.sliding_window == (8 if i % 2 == 0 else None)
        torch.testing.assert_close(attn.sinks, theirs.self_attn.sinks)
        moe, experts = ours.mlp, theirs.mlp.experts
        assert isinstance(moe, GptOssMoE)
        size = experts.intermediate_size
        w13 = moe.experts.w13_weight  # [E, 2I, H]: gate rows, then up rows
        torch.testing.assert_close(w13[:, :size], experts.gate_up_proj[..., 0::2].transpose(1, 2))
        torch.testing.assert_close(w13[:, size:], experts.gate_up_proj[..., 1::2].transpose(1, 2))
        torch.testing.assert_close(moe.experts.w13_bias[:, size:], experts.gate_up_proj_bias[:, 1::2])
        torch.testing.assert_close(moe.experts.w2_weight, experts.down_proj.transpose(1, 2))
        torch.testing.assert_close(moe.experts.w2_bias, experts.down_proj_bias)
        torch.testing.assert_close(moe.gate.bias, theirs.mlp.router.bias)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_sinks_change_the_answer(case: Case):
    """Guards the fixture: with the sinks zeroed transformers' logits move well past the
    tolerance, so the parity above holds only because tessera applies them."""
    prompt = prompt_ids(30, seed=5)
    before = hf_logits(case.hf, prompt)
    saved = [layer.self_attn.sinks.detach().clone() for layer in case.hf.model.layers]
    try:
        with torch.no_grad():
            for layer in case.hf.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        assert (hf_logits(case.hf, prompt) - before).abs().max() > 1e-2
    finally:
        with torch.no_grad():
            for layer, sinks in zip(case.hf.model.layers, saved):
                layer.self_attn.sinks.copy_(sinks)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] float -> (blocks [..., C/32, 16], scales [..., C/32]) uint8: each block of 32
    scaled by the power of two that brings its largest magnitude within 6, rounded to the
    nearest E2M1 value."""
    blocks = weight.float().reshape(*weight.shape[:-1], -1, 32)
    top = blocks.abs().amax(-1).clamp_min(2.0 ** -100)
    exponent = torch.ceil(torch.log2(top / 6.0))
    codes = (blocks / torch.exp2(exponent)[..., None]).unsqueeze(-1) - torch.tensor(E2M1_VALUES)
    codes = codes.abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def make_mxfp4_checkpoint(folder: Path, tokenizer_dir: Path, seed: int = 3) -> torch.nn.Module:
    """OpenAI's layout in `folder`: `<experts>.gate_up_proj_blocks` / `_scales` ([E, 2I, H/32,
    16] and [E, 2I, H/32], rows interleaving gate and up), `down_proj_blocks` / `_scales`, and
    quant_method mxfp4. Returns transformers' model holding exactly what the file decodes to."""
    from safetensors.torch import save_file

    dense = folder.with_name(folder.name + "-dense")
    hf = make_tiny_gpt_oss(dense, tokenizer_dir, seed=seed, intermediate_size=64)
    tensors = {name: t.contiguous() for name, t in iter_hf_weights(dense)}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # stored [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        module, attr = name.rsplit(".", 1)
        with torch.no_grad():
            getattr(hf.get_submodule(module), attr).copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    for tokenizer_file in dense.glob("tokenizer*"):
        (folder / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    assert (hf.model.layers[0].mlp.experts.down_proj != 0).float().mean() > 0.5  # not all rounded away
    return hf


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dequantized"])
def test_mxfp4_checkpoint(packed, tmp_path, tiny_tokenizer_dir, monkeypatch):
    """Tessera's logits equal transformers' on the dequantized weights, whether the stacks
    stay packed (the CPU kernel) or load dequantized (a device without an MXFP4 builder)."""
    from tessera.models.gpt_oss import modeling
    from tessera.ops.moe_mxfp4 import Mxfp4Experts

    hf = make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir)
    if not packed:
        monkeypatch.setattr(modeling, "mxfp4_experts_available", lambda target: False)
    llm = LLM(tmp_path / "mxfp4", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts) == packed
    if packed:
        assert experts.w13_blocks.dtype == torch.uint8 and experts.w13_blocks.shape == (4, 128, 2, 16)
        chosen = {c.builder.name for c in selections() if c.spec.kind == "moe_experts" and c.spec.quant == "mxfp4"}
        assert chosen <= {"cpu_mxfp4_experts", "torch_mxfp4_experts"} and chosen
    check_prefill_and_decode_logits(llm, hf, "gpt_oss-mxfp4", monkeypatch)
    if packed:  # bf16 inputs take the bf16 kernel on AVX512 CPUs
        check_bf16_close(tmp_path / "mxfp4", hf, NUM_KV_BLOCKS)
    info = inspect_model(ModelConfig(model=str(tmp_path / "mxfp4"), dtype="float32"), load=False)
    assert (info["checkpoint_quantization"], info["checkpoint_packed"]) == ("mxfp4", packed)
    assert ("kept packed" if packed else "dequantized as it loads") in format_report(info)


def test_bf16_runs_the_cpu_kernels_with_sinks(case: Case):
    """The C decode and prefill kernels with sinks are the ones chosen, and agree."""
    unavailable = paged_decode._KERNEL.check(None)
    if unavailable:
        pytest.skip("; ".join(unavailable))
    check_bf16_close(case.folder, case.hf, NUM_KV_BLOCKS)
    chosen = {c.builder.name for c in selections() if c.spec.kind == "paged_attention" and c.spec.sinks
              and c.spec.dtype == torch.bfloat16}
    assert "cpu_paged_decode_bf16" in chosen


def test_dummy_weights_fill_packed_stacks_with_usable_values(tmp_path, tiny_tokenizer_dir):
    """`--load-format dummy` (the gpt-oss-20b bench preset): packed stacks get random codes
    and moderate scales, so the model runs at its real cost and stays finite."""
    from tessera.ops.moe_mxfp4 import Mxfp4Experts

    make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir)
    llm = LLM(tmp_path / "mxfp4", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
              load_format="dummy")
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts)
    assert (experts.w13_scales == 121).all() and len(experts.w13_blocks.unique()) > 200
    out = llm.generate([prompt_ids(20, seed=1)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                               logprobs=0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and all(torch.isfinite(torch.tensor(lp[t].logprob))
                                           for t, lp in zip(out.token_ids, out.logprobs))
