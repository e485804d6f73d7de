"""Greedy parity with transformers on a CUDA GPU (skipped without one): tessera on the GPU
(Triton attention, norm, rotary and activation kernels, cuBLAS GEMMs, CUDA decode graphs
or eager) against transformers on the CPU, float32 exact to FP32_ATOL, bf16 within the
CPU bf16 tests' tolerance. Prompts cross cache blocks, batches mix prefills and decodes,
and a chunked prefill reads its cached prefix through the Triton prefill kernel."""
from __future__ import annotations

import copy

import pytest
import torch

from tessera import LLM

from tests.models.parity import (FP32_ATOL, LogitRecorder, assert_rows_match, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, greedy, hf_generate, hf_logits, prompt_ids)
from tests.models.test_llama_parity import BF16_ATOL, BF16_EXACT_TOKENS, make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = ("gqa-untied", "mha-tied", "rope-llama3", "bias")
PROMPT_LENGTHS = (5, 23, 47)


def _llm(folder, dtype: str, eager: bool, **kw) -> LLM:
    return LLM(folder, dtype=dtype, device="cuda", num_kv_blocks=64, block_size=16, max_num_seqs=16,
               enforce_eager=eager, show_progress=False, **kw)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", CASES)
def test_float32_on_the_gpu_matches_transformers(name, eager, make_tiny_llama, monkeypatch):
    folder, hf = make_checkpoint(make_tiny_llama, name)
    with _llm(folder, "float32", eager) as llm:
        check_prefill_and_decode_logits(llm, hf, f"{name} cuda", monkeypatch)
        check_greedy_alone_and_batched(llm, hf, PROMPT_LENGTHS)


def test_chunked_prefill_on_the_gpu_matches_transformers(make_tiny_llama, monkeypatch):
    folder, hf = make_checkpoint(make_tiny_llama, "gqa-untied")
    prompt = prompt_ids(100, seed=4)
    with _llm(folder, "float32", False, max_num_batched_tokens=32) as llm:
        rec = LogitRecorder(llm, monkeypatch)
        out = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert tokens == hf_generate(hf, prompt, len(tokens))
    assert_rows_match(rec.for_request(out.request_id), hf_logits(hf, prompt + tokens), FP32_ATOL,
                      "chunked cuda")


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_on_the_gpu_is_close_to_transformers(name, make_tiny_llama, monkeypatch):
    folder, hf = make_checkpoint(make_tiny_llama, name)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    prompt = prompt_ids(27, seed=5)
    with _llm(folder, "bfloat16", False) as llm:
        rec = LogitRecorder(llm, monkeypatch)
        out = llm.generate([prompt], greedy(16), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    reference = hf_logits(hf16, prompt + tokens)
    assert_rows_match(rec.for_request(out.request_id), reference, BF16_ATOL, f"{name} bf16 cuda")
    assert tokens[:BF16_EXACT_TOKENS] == hf_generate(hf16, prompt, BF16_EXACT_TOKENS)


def test_gpt_oss_and_deepseek_on_the_gpu_match_transformers(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The new kernels' paths on a GPU: gpt-oss's attention sinks through the Triton
    attention in float32, its MXFP4 experts kept packed through the Triton MXFP4 linear in
    bf16 (near the float32 reference), and DeepSeek-V3's MLA (a 40-wide latent KV head for
    four query heads) in float32."""
    from tests.models.test_deepseek import CASES as DEEPSEEK
    from tests.models.test_deepseek import make_tiny_deepseek
    from tests.models.test_gpt_oss import make_mxfp4_checkpoint, make_tiny_gpt_oss
    from tessera.ops.moe_mxfp4 import Mxfp4Experts

    hf = make_tiny_gpt_oss(tmp_path / "gpt-oss", tiny_tokenizer_dir, seed=2, intermediate_size=96)
    with _llm(tmp_path / "gpt-oss", "float32", False) as llm:
        check_prefill_and_decode_logits(llm, hf, "gpt-oss cuda", monkeypatch)
    kind, overrides = DEEPSEEK["v3-yarn-qlora"]
    hf = make_tiny_deepseek(tmp_path / "deepseek", tiny_tokenizer_dir, kind, seed=2, **overrides)
    with _llm(tmp_path / "deepseek", "float32", False) as llm:
        check_prefill_and_decode_logits(llm, hf, "deepseek cuda", monkeypatch)
    hf = make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir)
    prompt = prompt_ids(27, seed=5)
    with _llm(tmp_path / "mxfp4", "bfloat16", False) as llm:
        assert isinstance(llm.engine.runner.model.model.layers[0].mlp.experts, Mxfp4Experts)
        rec = LogitRecorder(llm, monkeypatch)
        out = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert_rows_match(rec.for_request(out.request_id), hf_logits(hf, prompt + tokens), BF16_ATOL, "mxfp4 cuda")


@pytest.mark.parametrize("family", ["qwen3_5_text", "granite-4.0-h-moe-nope", "lfm2-biased-conv"])
def test_hybrids_on_the_gpu_match_transformers(family, tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The recurrent layers on a GPU (the Triton conv, gated-delta and scan kernels, the
    state slots on the device) in float32: prefill and decode logits, greedy alone and
    batched, a chunked prefill, and a second turn restored from a state snapshot."""
    from tests.models.parity import check_beam_search, check_chunked_prefill, check_second_turn_restores_state
    from tests.models.test_granite_hybrid import make_tiny_granite_hybrid
    from tests.models.test_lfm2 import make_tiny_lfm2
    from tests.models.test_qwen3_next import make_tiny_qwen3_next

    make = {"qwen3_5_text": make_tiny_qwen3_next, "granite-4.0-h-moe-nope": make_tiny_granite_hybrid,
            "lfm2-biased-conv": make_tiny_lfm2}[family]
    hf = make(family, tmp_path, tiny_tokenizer_dir, seed=2)
    with _llm(tmp_path, "float32", False, enable_prefix_caching=False) as llm:
        assert llm.engine.runner.state_layers[0].state[0].is_cuda
        check_prefill_and_decode_logits(llm, hf, f"{family} cuda", monkeypatch)
        check_greedy_alone_and_batched(llm, hf, PROMPT_LENGTHS)
        check_chunked_prefill(tmp_path, llm, hf, f"{family} cuda", monkeypatch, 64, PROMPT_LENGTHS)
        check_beam_search(llm, hf)  # forks copy device states
    check_second_turn_restores_state(tmp_path, hf, 64)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_beam_search_on_the_gpu_matches_transformers(eager, make_tiny_llama):
    """Beams on the GPU: forks share device KV blocks, copy-on-write copies them on the
    device, and the Triton attention reads the copies (block size 16, so most forks copy)."""
    from tests.models.parity import check_beam_search

    folder, hf = make_checkpoint(make_tiny_llama, "gqa-untied")
    with _llm(folder, "float32", eager) as llm:
        check_beam_search(llm, hf, width=4, new_tokens=12)
        assert llm.engine.block_manager.all_free()


@pytest.mark.parametrize("case", ["e2b", "moe"])
def test_gemma4_on_the_gpu_matches_transformers(case, tmp_path, tiny_tokenizer_dir, monkeypatch):
    """Gemma 4 on a GPU in float32: the Triton attention at two head sizes with scale 1, the
    KV-shared layers over their producers' caches (prefill rows as decodes), keys as values,
    experts; CUDA decode graphs on; a chunked prefill."""
    from tests.models.parity import check_chunked_prefill
    from tests.models.test_gemma4 import make

    hf = make(tmp_path, tiny_tokenizer_dir, case)
    with _llm(tmp_path, "float32", False) as llm:
        check_prefill_and_decode_logits(llm, hf, f"gemma4 {case} cuda", monkeypatch)
        check_greedy_alone_and_batched(llm, hf, PROMPT_LENGTHS)
        check_chunked_prefill(tmp_path, llm, hf, f"gemma4 {case} cuda", monkeypatch, 64, PROMPT_LENGTHS)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs a Hopper GPU or later")
def test_programmatic_dependent_launch_matches_transformers(make_tiny_llama, monkeypatch):
    """TESSERA_PDL=1 (tessera/ops/triton/launch.py): each Triton kernel of a step scheduled
    while the one before runs, waiting for it in-kernel. float32 with graphs still exact,
    bf16 (the few-row linears) still close."""
    from tessera.ops.triton import launch

    monkeypatch.setenv(launch.FLAG, "1")
    launch._enabled.cache_clear()
    try:
        assert launch.launch_options(torch.zeros(1, device="cuda"))["PDL"]
        test_float32_on_the_gpu_matches_transformers("gqa-untied", False, make_tiny_llama, monkeypatch)
        test_bfloat16_on_the_gpu_is_close_to_transformers("gqa-untied", make_tiny_llama, monkeypatch)
    finally:
        launch._enabled.cache_clear()


def test_fused_few_row_kernels_on_the_gpu_are_close_to_transformers(make_tiny_llama, monkeypatch):
    """Every few-row kernel made the tuning's choice (a stand-in timer under which each beats
    its reference): the input norms applied while QKV and gate-up load their rows, SiLU-and-
    mul while down_proj loads its, plain linears. bf16 still close, greedy tokens still
    transformers'. A GPU's own timing keeps only the ones that measure faster, so this is
    what runs wherever they do."""
    from tessera.ops import kernel_tuning as tuning
    from tessera.ops.triton import skinny_linear

    monkeypatch.setattr(skinny_linear, "_timer",
                        lambda device: lambda runs: {name: 2e-5 if name == "torch" else 1e-5 for name in runs})
    skinny_linear._TABLE.clear()
    measured = len(tuning.records())
    try:
        test_bfloat16_on_the_gpu_is_close_to_transformers("gqa-untied", make_tiny_llama, monkeypatch)
    finally:
        skinny_linear._TABLE.clear()
    chosen = {record.key[-2:]: record.chosen for record in tuning.records()[measured:]}
    fused = {key for key, name in chosen.items() if name != "torch"}
    assert (None, ("rms_norm", True, torch.bfloat16)) in fused and ("silu_and_mul", None) in fused, chosen
