"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers.

transformers dequantizes the GGUF itself (its own reader, its own undoing of llama.cpp's
Q/K row permutation), so token-for-token agreement of greedy generation checks tessera's
GGUF loader as well as its model, kernels, scheduler and sampler. Both sides run float32.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM
from tessera.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
NUM_KV_BLOCKS = 96   # x 16 tokens: the whole batch below fits with room to spare
MAX_MODEL_LEN = 1024

PLAIN_PROMPTS = {
    "capital": "The capital of France is",
    "code": "def fibonacci(n):",
    "paragraph": ("Paged attention stores the key-value cache of every sequence in fixed-size "
                  "blocks, much like virtual memory pages. Continuous batching then lets new "
                  "requests join the running batch between steps, so that"),
}
CHAT_PROMPTS = {
    "haiku": [{"role": "user", "content": "Write a haiku about the sea."}],
    "system": [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "Explain what a hash table is in one sentence."}],
    "colors": [{"role": "user", "content": "List three primary colors."}],
}
NAMES = [*PLAIN_PROMPTS, *CHAT_PROMPTS]


def greedy(n: int = NEW_TOKENS, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=ignore_eos)


@pytest.fixture(scope="module")
def hf_model(default_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.fixture(scope="module")
def llm(default_gguf: Path) -> LLM:
    llm = LLM(None, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN,
              show_progress=False)
    assert llm.engine.router.source.path == default_gguf.resolve()
    return llm


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM, hf_tokenizer) -> dict[str, list[int]]:
    """Token ids per prompt name, checked against transformers' own tokenization."""
    ids: dict[str, list[int]] = {}
    for name, text in PLAIN_PROMPTS.items():
        ids[name] = llm.engine.encode(text)
        assert ids[name] == hf_tokenizer(text).input_ids, name
    for name, messages in CHAT_PROMPTS.items():
        ids[name] = llm.apply_chat_template(messages)
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ids[name] == hf_tokenizer(text, add_special_tokens=False).input_ids, name
    assert len({len(v) for v in ids.values()}) == len(ids), "prompt lengths should all differ"
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids) -> dict[str, list[int]]:
    out = {}
    with torch.no_grad():
        for name, ids in prompt_ids.items():
            seq = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            out[name] = seq[0, len(ids):].tolist()
            assert len(out[name]) == NEW_TOKENS
    return out


@pytest.fixture(scope="module")
def tessera_alone(llm, prompt_ids) -> dict[str, list[int]]:
    """Each prompt in its own generate call (plain prompts as text, chat ones as ids)."""
    out = {}
    for name, ids in prompt_ids.items():
        prompt = PLAIN_PROMPTS.get(name, ids)
        result = llm.generate(prompt, greedy(), use_tqdm=False)[0]
        assert result.prompt_token_ids == ids
        assert result.outputs[0].finish_reason == "length"
        out[name] = result.outputs[0].token_ids
    return out


def divergence(hf_model, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where two greedy continuations part, and how close transformers' top-2 logits were
    there (a near-tie is float noise; a wide gap is a real bug)."""
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.no_grad():
        row = hf_model(torch.tensor([prompt + want[:i]])).logits[0, -1].float()
    return (f"first differs at token {i}: tessera {got[i]} (logit {row[got[i]]:.5f}) vs "
            f"transformers {want[i]} (logit {row[want[i]]:.5f})")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(name, tessera_alone, hf_greedy, hf_model, prompt_ids):
    got, want = tessera_alone[name], hf_greedy[name]
    if got != want:
        pytest.fail(f"{name}: {divergence(hf_model, prompt_ids[name], got, want)}")


def test_batched_equals_alone(llm, prompt_ids, tessera_alone):
    prompts = [PLAIN_PROMPTS.get(name, prompt_ids[name]) for name in NAMES]
    results = llm.generate(prompts, greedy(), use_tqdm=False)
    for name, result in zip(NAMES, results):
        assert result.prompt_token_ids == prompt_ids[name]
        assert result.outputs[0].token_ids == tessera_alone[name], name


def test_chat_answers_paris(llm):
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params,
                   use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("eos_token", "length")
    assert len(out.token_ids) <= 32
    if out.finish_reason == "eos_token":
        assert out.token_ids[-1] in llm.engine.router.eos_token_ids


def test_watermarked_chat_text_is_detected_from_its_text_alone(llm, prompt_ids):
    """The real use: a watermarked answer, later seen only as text (re-tokenized), is
    detected; the same answers unwatermarked, in the same batch, are not. The default
    gamma 0.5 and delta 2; 150 tokens scored z 7.1-7.5 here (sampling on another CPU draws
    other tokens: z is about 7 +- 1 for these prompts, so 4 is far)."""
    prompts = [prompt_ids["haiku"], prompt_ids["colors"]] * 2
    marks = [True, True, False, False]
    outs = llm.generate(prompts, [SamplingParams(seed=i, watermark=mark, max_new_tokens=150, temperature=1.0,
                                                 ignore_eos=True) for i, mark in enumerate(marks)],
                        use_tqdm=False)
    for mark, out in zip(marks, outs):
        by_text = llm.detect_watermark(out.outputs[0].text)
        exact = llm.detect_watermark(out.outputs[0].token_ids, prompt=out.prompt_token_ids)
        assert exact.num_tokens_scored == 150
        assert by_text.prediction is mark and exact.prediction is mark, (by_text, exact)
