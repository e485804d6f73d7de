"""Watermarked generation end to end on a tiny llama: greedy output equals transformers'
generate with the same watermark (lefthash, same key and ratio); drafts verified by n-gram
speculation and a batch of mixed requests change nothing; the output is detected, by
tessera and by transformers' detector, and unmarked output is not."""
from __future__ import annotations

import pytest
import torch
from transformers import WatermarkDetector, WatermarkingConfig

from tessera import LLM, SamplingParams
from tessera.config import WatermarkConfig
from tessera.sampling.watermark import detect_watermark

from tests.engine.test_sampling_engine import VOCAB, checkpoint, make_llm, prompt_ids  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


def hf_watermarked(model, prompt: list[int], n: int, config: WatermarkConfig) -> list[int]:
    marking = WatermarkingConfig(greenlist_ratio=config.gamma, bias=config.delta, hashing_key=config.key)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None, watermarking_config=marking)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("config", [WatermarkConfig(), WatermarkConfig(gamma=0.25, delta=1.0, key=77)])
def test_greedy_watermarked_output_equals_transformers_generate(make_llm, checkpoint, config):
    llm = make_llm(watermark=config)
    prompts = [prompt_ids(9, 1), prompt_ids(21, 2), prompt_ids(5, 3)]
    marked = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, watermark=True)
    plain = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    # a plain request in the same batch keeps its plain output
    outs = llm.generate(prompts + prompts[:1], [marked] * 3 + [plain])
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_watermarked(checkpoint[1], prompt, 24, config)
    unmarked = llm.generate(prompts[:1], plain)[0].outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == unmarked
    assert outs[0].outputs[0].token_ids != unmarked, "test setup: the watermark should change the output"


def test_speculation_verifies_drafts_against_the_watermarked_choice(make_llm):
    """Each verifying row's list is seeded by the draft before it, so accepting drafts
    gives what one token a step gives."""
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": None}
    repetitive = [prompt_ids(6, 4) * 4, prompt_ids(5, 5) * 5]  # n-gram lookups find drafts
    params = [SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, watermark=True),
              SamplingParams(temperature=0.8, seed=11, max_new_tokens=32, ignore_eos=True, watermark=True)]
    expected = [o.outputs[0].token_ids for o in make_llm().generate(repetitive, params)]
    speculating = make_llm(speculative_config=spec)
    assert [o.outputs[0].token_ids for o in speculating.generate(repetitive, params)] == expected
    assert speculating.engine.stats().spec_draft_tokens > 0, "test setup: drafts were verified"


def test_watermarked_samples_are_detected_and_plain_samples_are_not(make_llm, checkpoint):
    config = WatermarkConfig(delta=4.0)
    llm = make_llm(watermark=config)
    prompts = [prompt_ids(8, s) for s in range(4)]
    base = dict(temperature=1.0, max_new_tokens=64, ignore_eos=True)
    marked = llm.generate(prompts, [SamplingParams(seed=s, watermark=True, **base) for s in range(4)])
    plain = llm.generate(prompts, [SamplingParams(seed=s, **base) for s in range(4)])
    detector = WatermarkDetector(model_config=checkpoint[1].config, device="cpu",
                                 watermarking_config=WatermarkingConfig(greenlist_ratio=config.gamma,
                                                                        bias=config.delta))
    for prompt, out in zip(prompts, marked):
        ids = prompt[-1:] + out.outputs[0].token_ids
        score = detect_watermark(ids, VOCAB, config)
        assert score.prediction and score.num_tokens_scored == 64, score
        theirs = detector(torch.tensor([ids]), z_threshold=4.0, return_dict=True)
        assert theirs.num_green_tokens[0] == score.num_green_tokens and theirs.prediction[0]
    for prompt, out in zip(prompts, plain):
        score = detect_watermark(prompt[-1:] + out.outputs[0].token_ids, VOCAB, config)
        assert not score.prediction, score
