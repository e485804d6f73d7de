"""--kv-cache-dtype fp8 through the engine: the cache holds 8-bit floats at half (bf16) or a
quarter (float32) of the bytes; prefix-cache hits, chunked prefill and speculative decoding
give what one whole prefill gives (every attention reads this step's K/V rounded from the
cache: float32 exactly, bf16 up to a near-tie that a step of other rows rounds the other
way); captured decode graphs replay it; outputs stay close to the model-dtype
cache; bad names are clear errors."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.cli import build_parser
from tessera.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SYSTEM = list(range(10, 47))  # a shared 37-token prefix
# the last two loop under greedy decoding, so n-gram drafts get accepted
PROMPTS = [SYSTEM + [60 + i, 61 + 2 * i][: 1 + i % 2] for i in range(4)] + [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9]]


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    # a wider initialisation than the default: decisive logits, so greedy tokens are stable
    return make_tiny_llama(seed=3, initializer_range=0.1)[0]


def make(folder, dtype: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    return LLM(folder, dtype=dtype, block_size=4, show_progress=False, **kwargs)


def run(llm: LLM, prompts=PROMPTS, n: int = 16, prompt_logprobs: bool = False,
        tops: bool = False) -> list[tuple]:
    """Greedy tokens and their logprobs (after the prompt's own, if asked: those requests
    skip the prefix cache); with `tops`, also each output position's top 2 {token: logprob}."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2 if tops else 0,
                            prompt_logprobs=0 if prompt_logprobs else None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        prompt = ([lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
                  if prompt_logprobs else [])
        item = (c.token_ids, prompt + [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        if tops:
            item += ([{t: lp.logprob for t, lp in position.items()} for position in c.logprobs],)
        result.append(item)
    return result


def assert_same(got, want, tol: float) -> None:
    """Tokens equal, logprobs within `tol`. Where `got` has each position's top 2 (bf16),
    the tokens may part at a near-tie: a step of other rows (a chunk, a cached prefix)
    may round it the other way, so there the wanted token must be in got's top 2 within
    `tol` of its choice (vLLM's check_logprobs_close), and the comparison ends."""
    for (tokens, lps, *top), (want_tokens, want_lps) in zip(got, want, strict=True):
        if top and tokens != want_tokens:
            i = next(i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b)
            at = top[0][i]
            assert want_tokens[i] in at and at[tokens[i]] - at[want_tokens[i]] <= tol, (i, at)
            tokens, lps, want_tokens, want_lps = tokens[:i], lps[:i], want_tokens[:i], want_lps[:i]
        assert tokens == want_tokens
        assert max((abs(a - b) for a, b in zip(lps, want_lps, strict=True)), default=0.0) <= tol


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv", list(FP8))
def test_cache_holds_fp8_at_a_fraction_of_the_bytes(tiny, dtype, kv):
    with make(tiny, dtype) as plain, make(tiny, dtype, kv_cache_dtype=kv) as small:
        runner = small.engine.runner
        assert all(c.dtype == FP8[kv] for layer in runner.attn_layers for c in layer.kv_cache)
        ratio = plain.engine.runner.kv_bytes_per_block() / runner.kv_bytes_per_block()
        assert ratio == (2 if dtype == "bfloat16" else 4)
        assert runner.attn_layers[0].kv_cache[0].nbytes * ratio == plain.engine.runner.attn_layers[0].kv_cache[0].nbytes


# bfloat16 runs the C kernels, float32 the pure-torch attention
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv", list(FP8))
def test_prefix_hits_chunks_and_drafts_give_what_one_prefill_gives(tiny, dtype, kv):
    with make(tiny, dtype, kv_cache_dtype=kv, enable_prefix_caching=False, enforce_eager=True) as llm:
        want = run(llm)
    tol = 2e-2 if dtype == "bfloat16" else 1e-4  # summation order in bf16 outputs; float32
    bf16 = dtype == "bfloat16"
    with make(tiny, dtype, kv_cache_dtype=kv) as llm:  # prefix caching on
        run(llm, PROMPTS[:1])
        assert_same(run(llm, tops=bf16), want, tol)
        assert llm.engine.block_manager.prefix_hits > 0
    with make(tiny, dtype, kv_cache_dtype=kv, enable_prefix_caching=False,
              max_num_batched_tokens=16, max_num_seqs=4) as llm:  # prompts in chunks of <= 16
        assert_same(run(llm, tops=bf16), want, tol)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "disable_by_batch_size": 8}
    with make(tiny, dtype, kv_cache_dtype=kv, enable_prefix_caching=False, speculative_config=spec) as llm:
        # (a verifying step holds more rows: bf16 may round a near-tie the other way)
        assert_same([(tokens, [], *top) for tokens, _, *top in run(llm, tops=bf16)],
                    [(tokens, []) for tokens, _ in want], tol)
        assert llm.engine.stats().spec_accepted_tokens > 0


def test_decode_graphs_replay_the_fp8_cache(tiny):
    results = {}
    for eager in (True, False):
        with make(tiny, "bfloat16", kv_cache_dtype="fp8", enforce_eager=eager) as llm:
            results[eager] = run(llm)
            if not eager:
                graphs = llm.engine.runner.graphs
                assert graphs.captured_sizes and graphs.eager_sizes == []
    assert results[False] == results[True]


# measured on this checkpoint (logits of a 0.1-std initialisation): e4m3 max 0.11 / mean
# 0.025 nats, e5m2 (one mantissa bit fewer) 0.13 / 0.05
@pytest.mark.parametrize("kv, tol, mean_tol", [("fp8", 0.2, 0.04), ("fp8_e5m2", 0.25, 0.08)])
def test_outputs_stay_close_to_the_model_dtype_cache(tiny, kv, tol, mean_tol):
    """Teacher-forced: every prompt token's logprob, one greedy token after it."""
    with make(tiny, "float32") as llm:
        want = run(llm, n=1, prompt_logprobs=True)
    with make(tiny, "float32", kv_cache_dtype=kv) as llm:
        got = run(llm, n=1, prompt_logprobs=True)
    diffs = [abs(a - b) for (_, lps), (_, ref) in zip(got, want) for a, b in zip(lps, ref, strict=True)]
    assert max(diffs) <= tol, max(diffs)
    assert 0 < sum(diffs) / len(diffs) <= mean_tol  # rounded: not a model-dtype cache in disguise
    assert sum(g == w for (g, _), (w, _) in zip(got, want)) >= len(want) - 1  # e5m2 flips one


def test_bad_kv_cache_dtype_is_a_clear_error(tiny):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of .*fp8_e5m2.* got 'int4'"):
        make(tiny, "float32", kv_cache_dtype="int4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "fp16", "hi"])
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3fn"])  # TGI's spelling
    assert args.kv_cache_dtype == "fp8_e4m3fn"
