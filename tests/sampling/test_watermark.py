"""The green-list watermark against transformers' implementation of the same scheme
(WatermarkLogitsProcessor "lefthash", WatermarkDetector): the same green lists, the same
biased logits, the same detection statistics; then the sampler's use of it."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, WatermarkDetector, WatermarkingConfig
from transformers.generation.logits_process import WatermarkLogitsProcessor

from tessera.config import ConfigError, WatermarkConfig
from tessera.llm import engine_config
from tessera.sampling import Sampler, SamplingBatch, SamplingParams
from tessera.sampling.watermark import GreenLists, apply_watermark, detect_watermark, unpack

VOCAB = 1000


def hf_processor(config: WatermarkConfig, vocab: int = VOCAB) -> WatermarkLogitsProcessor:
    return WatermarkLogitsProcessor(vocab_size=vocab, device="cpu", greenlist_ratio=config.gamma,
                                    bias=config.delta, hashing_key=config.key)


CONFIGS = [WatermarkConfig(), WatermarkConfig(gamma=0.25, delta=1.5, key=987654321),
           WatermarkConfig(key=2**62 + 12345)]  # key x token beyond 2**64: the reduction matters


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("vocab", [VOCAB, 1003])  # 1003: the packed lists' last byte is partial
def test_green_lists_are_transformers_lefthash_lists(config, vocab):
    green, hf = GreenLists(config, vocab), hf_processor(config, vocab)
    for previous in (0, 1, 7, 499, vocab - 1):
        expected = hf._get_greenlist_ids(torch.tensor([5, previous]))
        mask = green.mask(previous)
        assert mask.shape == (vocab,) and mask.sum() == int(vocab * config.gamma) == expected.numel()
        assert torch.equal(mask.nonzero().flatten(), expected.sort().values)
    assert not torch.equal(green.mask(3), green.mask(4)), "each previous token seeds its own list"


@pytest.mark.parametrize("config", CONFIGS)
def test_biased_logits_equal_transformers(config):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, :10] = float("-inf")  # masked tokens stay masked
    history = torch.tensor([[4, 17], [9, 250], [3, 17]])
    expected = hf_processor(config)(history, logits.clone())
    ours = apply_watermark(logits.clone(), [0, 1, 2], history[:, -1].tolist(), GreenLists(config, VOCAB))
    assert torch.equal(ours, expected)
    # only the listed rows move
    some = apply_watermark(logits.clone(), [1], [250], GreenLists(config, VOCAB))
    assert torch.equal(some[[0, 2]], logits[[0, 2]]) and torch.equal(some[1], expected[1])


def test_the_list_cache_is_bounded_and_evictions_recompute_the_same_list():
    config = WatermarkConfig()
    green = GreenLists(config, VOCAB, cache_bytes=0)  # the smallest cache: 64 lists
    first = green.mask(5)
    first[:] = False  # a copy: the cache is not the caller's to change
    assert torch.equal(green.mask(5), GreenLists(config, VOCAB).mask(5))
    expected = {t: GreenLists(config, VOCAB).mask(t) for t in (5, 300, 301)}
    for previous in range(100, 200):
        green.packed([previous])
    assert len(green._lists) == green.capacity == 64 and 5 not in green._lists
    assert torch.equal(green.mask(5), expected[5])
    # one step needing more lists than the cache holds keeps them all for that step
    tokens = list(range(400, 480)) + [300, 301, 300]
    packed = green.packed(tokens)
    assert packed.shape == (83, -(-VOCAB // 8)) and len(green._lists) == 82
    rows = unpack(packed, VOCAB).bool()
    assert torch.equal(rows[80], expected[300]) and torch.equal(rows[81], expected[301])
    assert torch.equal(rows[82], expected[300])
    assert [green.is_green(300, t) for t in range(VOCAB)] == expected[300].tolist()


def hf_detector(config: WatermarkConfig, vocab: int = VOCAB, ignore_repeated_ngrams: bool = False):
    model_config = LlamaConfig(vocab_size=vocab, bos_token_id=vocab + 5)  # no id is BOS
    return WatermarkDetector(model_config=model_config, device="cpu",
                             watermarking_config=WatermarkingConfig(greenlist_ratio=config.gamma,
                                                                    bias=config.delta,
                                                                    hashing_key=config.key),
                             ignore_repeated_ngrams=ignore_repeated_ngrams)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("ignore_repeated", [False, True])
def test_detection_statistics_equal_transformers_detector(config, ignore_repeated):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (300,), generator=g)  # a small alphabet: bigrams repeat
    ours = detect_watermark(ids.tolist(), VOCAB, config, ignore_repeated_bigrams=ignore_repeated)
    theirs = hf_detector(config, ignore_repeated_ngrams=ignore_repeated)(
        ids.unsqueeze(0), z_threshold=4.0, return_dict=True)
    assert ours.num_tokens_scored == theirs.num_tokens_scored[0]
    assert ours.num_green_tokens == theirs.num_green_tokens[0]
    assert ours.z_score == pytest.approx(float(theirs.z_score[0]), abs=1e-9)
    assert ours.p_value == pytest.approx(float(theirs.p_value[0]), abs=1e-9)
    assert ours.prediction == bool(theirs.prediction[0])
    if ignore_repeated:
        assert ours.num_tokens_scored < 299, "test setup: some bigrams repeat"


def test_text_of_green_tokens_is_detected_and_random_text_is_not():
    config = WatermarkConfig()
    green = GreenLists(config, VOCAB)
    ids, g = [11], torch.Generator().manual_seed(4)
    for _ in range(60):  # a random green token each time: the strongest possible watermark
        choices = green.mask(ids[-1]).nonzero().flatten()
        ids.append(int(choices[torch.randint(len(choices), (1,), generator=g)]))
    marked = detect_watermark(ids, VOCAB, config)
    assert marked.num_green_tokens == marked.num_tokens_scored == 60
    assert marked.z_score == pytest.approx(math.sqrt(60)) and marked.prediction
    assert marked.p_value < 1e-9
    other_key = detect_watermark(ids, VOCAB, WatermarkConfig(key=12345))
    assert not other_key.prediction and abs(other_key.z_score) < 4
    plain = detect_watermark(torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(2)).tolist(),
                             VOCAB, config)
    assert abs(plain.z_score) < 4 and not plain.prediction
    # ids beyond the vocabulary (added tokens) are never green
    assert detect_watermark([5, VOCAB + 3], VOCAB, config).num_green_tokens == 0


def test_too_short_texts_and_bad_settings_are_errors():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        detect_watermark([5], VOCAB, WatermarkConfig())
    for kwargs, match in [({"gamma": 0.0}, "gamma"), ({"gamma": 1.0}, "gamma"), ({"delta": 0}, "delta"),
                          ({"delta": float("inf")}, "delta"), ({"delta": float("nan")}, "delta"),
                          ({"key": 0}, "key"), ({"key": 2.5}, "key"), ({"key": True}, "key")]:
        with pytest.raises(ConfigError, match=match):
            WatermarkConfig(**kwargs)
    with pytest.raises(ValueError, match="watermark"):
        SamplingParams(watermark="yes")
    with pytest.raises(ConfigError, match=r"got \['bad'\]"):
        engine_config(watermark={"bad": 1})
    assert engine_config(watermark={"delta": 3.0}).watermark == WatermarkConfig(delta=3.0)
    with pytest.raises(ConfigError, match=r"\[1, 2\*\*64 - 1\)") as caught:
        WatermarkConfig(key=2**64 - 1)  # every list would be the same
    assert str(2**64 - 1) not in str(caught.value)  # a key is not echoed


def test_sampler_biases_only_watermarked_rows_after_their_last_token():
    config = WatermarkConfig(delta=3.0)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0, watermark=True), SamplingParams(temperature=0),
              SamplingParams(temperature=0, watermark=True, logprobs=0)]
    history = [[1, 2, 30], [1, 2, 31], [7, 8]]
    batch = SamplingBatch(params, [None] * 3, token_ids=history, num_prompt_tokens=[2, 2, 1],
                          draft_token_ids=[[], [], [44]])  # row 2 verifies a draft: 44 is last
    sampler = Sampler(watermark=config, logprobs_mode="processed")
    out = sampler.sample(logits.clone(), batch)
    expected = hf_processor(config)(torch.tensor([[30], [44]]), logits[[0, 2]].clone())
    assert out.token_ids.tolist() == [int(expected[0].argmax()), int(logits[1].argmax()),
                                      int(expected[1].argmax())]
    assert out.logprobs[2].logprob == pytest.approx(float(expected[1].log_softmax(-1).max()), abs=1e-5)
    assert params[0].needs_token_history and not params[1].needs_token_history


def test_watermark_applies_before_the_repetition_penalty_as_in_tgi():
    config = WatermarkConfig()
    lists = GreenLists(config, VOCAB)
    previous = next(p for p in range(10, 100) if lists.mask(p)[5])  # seen token 5 is green
    logits = torch.full((1, VOCAB), 1.0)
    batch = SamplingBatch([SamplingParams(temperature=0, watermark=True, repetition_penalty=2.0)], [None],
                          token_ids=[[5, previous]], num_prompt_tokens=[1])
    processed = Sampler(watermark=config)._preprocess(logits, batch)[0]
    green = lists.mask(previous)
    expected = torch.where(green, torch.tensor(3.0), torch.tensor(1.0))
    expected[[5, previous]] /= 2.0  # (logit + delta) / penalty, not logit / penalty + delta
    assert torch.equal(processed, expected)
    assert processed[5] == 1.5


def test_watermark_applies_before_temperature_and_top_k_as_in_tgi():
    """TGI biases the raw logits, then warps: the sampled distribution is
    top_k((logits + delta * green) / T), not (top_k(logits / T) + delta * green)."""
    config = WatermarkConfig(delta=2.0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    params = SamplingParams(temperature=0.5, top_k=40, watermark=True, logprobs=0, seed=1)
    batch = SamplingBatch([params], [torch.Generator().manual_seed(1)], token_ids=[[9, 21]],
                          num_prompt_tokens=[1])
    out = Sampler(watermark=config, logprobs_mode="processed").sample(logits.clone(), batch)
    green = GreenLists(config, VOCAB).mask(21)
    warped = (logits[0] + config.delta * green) / 0.5
    kept = warped.topk(40).indices
    expected = torch.full_like(warped, float("-inf"))
    expected[kept] = warped[kept]
    chosen = int(out.token_ids[0])
    assert chosen in kept.tolist()
    assert out.logprobs[0].logprob == pytest.approx(float(expected.log_softmax(-1)[chosen]), abs=1e-5)
    other = (logits[0] / 0.5).topk(40).indices
    assert set(kept.tolist()) != set(other.tolist()), "test setup: the order changes the kept set"
