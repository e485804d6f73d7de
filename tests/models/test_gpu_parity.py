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
