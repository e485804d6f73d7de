"""Speculative decoding with a draft model: outputs are plain decoding's (greedy token for
token with stops, limits and penalties; seeded sampling too), while the draft's own KV
cache, kept in the target's blocks, stays right through rejections, preemption, prefix
hits, chunked catch-up and tensor parallelism. A draft equal to the target has every
draft accepted: any stale or missing draft KV would show as a rejection. Every engine
ends with all KV blocks free."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import ConfigError, speculative_config_from
from tessera.engine.draft_model_proposer import DRAFT_PLACEHOLDER, DraftModelProposer
from tessera.engine.sequence import Sequence
from tessera.runner.inputs import ModelInputs
from tessera.runner.model_runner import ModelRunner
from tessera.runner.warmup import DraftSizing, plan_kv_cache
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)
from tests.engine.test_speculative import (assert_idle_and_free, assert_speculated, assert_streamed_deltas_add_up,
                                           greedy, tokens_and_text)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


@pytest.fixture(scope="module")
def half_draft(tiny, tmp_path_factory):
    """The target's first layer alone (same embeddings and LM head): it agrees with the
    target on some tokens, not all, so both acceptance and rejection happen."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    folder = tmp_path_factory.mktemp("half-draft")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def other_draft(make_tiny_llama):
    """An unrelated random model of the same vocabulary: nearly every draft is rejected."""
    folder, _ = make_tiny_llama(seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return folder


@pytest.fixture
def make_pair(tiny):
    """make_pair(draft, k=4, **kwargs) -> (plain LLM, LLM drafting with `draft`)."""
    built: list[LLM] = []

    def make(draft, k: int = 4, quantization: str | None = None, **kwargs) -> tuple[LLM, LLM]:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("dtype", "float32")
        spec = {"model": str(draft), "num_speculative_tokens": k, "disable_by_batch_size": None,
                "quantization": quantization}
        pair = (LLM(tiny, show_progress=False, **kwargs),
                LLM(tiny, show_progress=False, speculative_config=spec, **kwargs))
        built.extend(pair)
        return pair

    yield make
    assert_idle_and_free(built)


def rate(llm: LLM) -> float:
    return llm.engine.stats().spec_acceptance_rate


def draft_passes(llm: LLM, monkeypatch) -> list[ModelInputs]:
    """The inputs of every pass `llm`'s draft model runs from now on."""
    runner, seen = llm.engine.proposer.runner, []
    run_model = ModelRunner._run_model

    def spy(self, inputs):
        if self is runner:
            seen.append(inputs)
        return run_model(self, inputs)

    monkeypatch.setattr(ModelRunner, "_run_model", spy)
    return seen


# --- config --------------------------------------------------------------------------------


def test_draft_model_config_parsing():
    config = speculative_config_from({"model": "d", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "d", 3)
    quantized = speculative_config_from({"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
                                         "quantization": "int8"})
    assert quantized.quantization == "int8"
    for bad in ({"method": "draft_model", "num_speculative_tokens": 3},      # no model
                {"method": "ngram", "model": "d", "num_speculative_tokens": 3},
                {"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
                {"model": "d", "num_speculative_tokens": 3, "quantization": "nf4"},
                {"num_speculative_tokens": 3, "quantization": "int8"},       # n-gram has no weights
                {"model": 7, "num_speculative_tokens": 3}):
        with pytest.raises(ConfigError):
            speculative_config_from(bad)


def test_a_draft_of_another_vocabulary_is_refused(tiny, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["other words entirely"] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(tiny, show_progress=False, num_kv_blocks=64,
            speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})


# --- outputs -------------------------------------------------------------------------------


def test_a_draft_equal_to_the_target_has_every_draft_accepted(make_pair, tiny, monkeypatch):
    """float32, same weights: the draft's greedy tokens are the target's, so a rejection
    could only come from draft KV at a wrong position or never written. And the draft
    computes each position once (the KV it keeps is reused, never recomputed)."""
    plain, spec = make_pair(tiny)
    assert isinstance(spec.engine.proposer, DraftModelProposer)
    passes = draft_passes(spec, monkeypatch)
    expected = plain.generate(TEXTS, greedy(40))
    assert tokens_and_text(spec.generate(TEXTS, greedy(40))) == tokens_and_text(expected)
    stats = spec.engine.stats()
    assert stats.spec_draft_tokens > 100 and stats.spec_accepted_tokens == stats.spec_draft_tokens, stats
    positions = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in expected)
    assert positions - len(TEXTS) * 5 <= sum(p.input_ids.shape[0] for p in passes) <= positions


def test_outputs_equal_plain_decoding_with_a_partly_agreeing_draft(make_pair, half_draft):
    plain, spec = make_pair(half_draft)
    full = [o.outputs[0].token_ids for o in plain.generate(TEXTS, greedy(40))]
    params = []
    for i, tokens in enumerate(full):
        if i % 4 == 0:
            params.append(greedy(40, stop_token_ids=[tokens[5 + i]]))
        elif i % 4 == 1:
            text = plain.tokenizer.decode(tokens[:9 + i])
            params.append(greedy(40, stop=[text[-4:]]))
        elif i % 4 == 2:
            params.append(greedy(3 + i))  # length limits fall inside drafts
        else:
            params.append(greedy(40, repetition_penalty=1.3, frequency_penalty=0.2))
    expected = plain.generate(TEXTS, params)
    assert tokens_and_text(spec.generate(TEXTS, params)) == tokens_and_text(expected)
    assert_speculated(spec)
    assert 0.1 < rate(spec) < 0.95, spec.engine.stats()


def test_an_unrelated_draft_costs_acceptance_not_correctness(make_pair, other_draft):
    plain, spec = make_pair(other_draft, k=3)
    assert tokens_and_text(spec.generate(TEXTS, greedy(32))) == tokens_and_text(plain.generate(TEXTS, greedy(32)))
    assert spec.engine.stats().spec_draft_tokens > 100
    assert rate(spec) < 0.3


def test_a_draft_with_a_wider_lm_head_never_proposes_past_the_targets_vocabulary(
        make_pair, make_tiny_llama, tmp_path):
    """Model families pad the LM head differently (Qwen2.5's small models vs large): the
    draft's padded rows here score highest, and must not become drafts."""
    from transformers import LlamaForCausalLM

    folder, _ = make_tiny_llama(seed=3, vocab_size=640)
    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight[512:] *= 50
    model.save_pretrained(folder)
    plain, spec = make_pair(folder, k=2)
    assert tokens_and_text(spec.generate(TEXTS, greedy(16))) == tokens_and_text(plain.generate(TEXTS, greedy(16)))
    assert spec.engine.stats().spec_draft_tokens > 0


def test_seeded_sampling_gives_plain_decodings_tokens(make_pair, half_draft):
    plain, spec = make_pair(half_draft, k=3, max_num_seqs=16)
    params = [SamplingParams(temperature=t, top_p=0.95, max_new_tokens=16, seed=s, ignore_eos=True)
              for s in range(12) for t in (0.05, 0.8)]
    prompts = (TEXTS * 3)[:len(params)]
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert tokens_and_text(spec.generate(prompts, params, use_tqdm=False)) == tokens_and_text(expected)
    assert_speculated(spec)


def test_preemption_prefix_hits_and_chunked_catch_up_keep_outputs(make_pair, tiny, monkeypatch):
    """Few blocks (preemption frees a sequence's blocks and its draft KV with them), a
    16-token budget (the draft computes a prompt in passes of at most 16 tokens), and a
    second round whose prompts hit the prefix cache (the draft computes them itself)."""
    plain, spec = make_pair(tiny, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=16)
    passes = draft_passes(spec, monkeypatch)
    expected = plain.generate(TEXTS, greedy(40))
    got = spec.generate(TEXTS, greedy(40))
    assert tokens_and_text(got) == tokens_and_text(expected)
    assert spec.engine.scheduler.num_preemptions > 0
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0, stats
    assert max(p.input_ids.shape[0] for p in passes) == 16  # prompts longer than the budget: in chunks
    hits = spec.engine.block_manager.prefix_hits
    again = [p + o.outputs[0].text for p, o in zip(TEXTS, got)]
    assert tokens_and_text(spec.generate(again, greedy(8))) == tokens_and_text(plain.generate(again, greedy(8)))
    assert spec.engine.block_manager.prefix_hits > hits
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens, stats


def test_n_best_of_and_streamed_deltas(make_pair, tiny):
    plain, spec = make_pair(tiny)
    params = SamplingParams(temperature=0.5, max_new_tokens=24, n=2, best_of=3, seed=7, ignore_eos=True)
    assert tokens_and_text(spec.generate(TEXTS[:3], params)) == tokens_and_text(plain.generate(TEXTS[:3], params))
    assert_streamed_deltas_add_up(plain, spec)


def test_an_int8_draft_of_the_target_itself(make_pair, tiny):
    plain, spec = make_pair(tiny, quantization="int8")
    assert spec.engine.proposer.runner.model is not spec.engine.model
    assert tokens_and_text(spec.generate(TEXTS, greedy(32))) == tokens_and_text(plain.generate(TEXTS, greedy(32)))
    assert rate(spec) > 0.7, spec.engine.stats()


def test_no_draft_pass_beyond_the_draft_models_positions(make_pair, make_tiny_llama, monkeypatch):
    """The target's weights with a 24-position context: drafts stop where the draft's
    positions end (the target goes on alone), and every draft made is accepted."""
    short, _ = make_tiny_llama(seed=0, max_position_embeddings=24)
    plain, spec = make_pair(short)
    assert spec.engine.proposer.max_model_len == 24 and spec.engine.max_model_len == 512
    passes = draft_passes(spec, monkeypatch)
    assert tokens_and_text(spec.generate(TEXTS, greedy(40))) == tokens_and_text(plain.generate(TEXTS, greedy(40)))
    assert max(int(p.positions.max()) for p in passes) == 23
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0, stats


def test_warm_up_sizes_the_cache_for_both_models_within_the_drafts_context(tiny, make_tiny_llama, caplog):
    """No num_kv_blocks: warm-up profiles the draft too, at most over its own 24 positions
    (a 64-token pass would run past its rotary table), and a block costs both models' bytes."""
    short, _ = make_tiny_llama(seed=0, max_position_embeddings=24, num_hidden_layers=1)
    with caplog.at_level("INFO", logger="tessera.runner.warmup"):
        llm = LLM(tiny, show_progress=False, dtype="float32", block_size=4, memory_fraction=0.02,
                  max_num_batched_tokens=64, max_num_seqs=4,
                  speculative_config={"model": str(short), "num_speculative_tokens": 2})
    target, draft = llm.engine.runner, llm.engine.proposer.runner
    assert draft.kv_bytes_per_block() * 2 == target.kv_bytes_per_block()  # 1 layer of 2
    assert "the draft model's included" in caplog.text
    plan = plan_kv_cache(target, memory_fraction=0.02, max_num_batched_tokens=64, max_num_seqs=4,
                         max_model_len=512, draft=DraftSizing(draft, 24))
    assert plan.bytes_per_block == target.kv_bytes_per_block() + draft.kv_bytes_per_block()
    target.allocate_kv_cache(llm.engine.num_blocks)  # (the plan's scratch caches were released)
    draft.allocate_kv_cache(llm.engine.num_blocks)
    assert tokens_and_text(llm.generate(TEXTS[:2], greedy(30)))[0][0][2] == "length"


def test_a_draft_with_a_narrower_vocabulary_reads_the_targets_extra_tokens(make_tiny_llama):
    """A target whose vocabulary (640) is wider than its draft's (512; same tokenizer): a
    prompt token past the draft's table neither crashes the draft nor changes outputs."""
    wide, _ = make_tiny_llama(seed=0, vocab_size=640)
    narrow, _ = make_tiny_llama(seed=0)
    kwargs = dict(num_kv_blocks=128, block_size=4, dtype="float32", show_progress=False)
    prompts = [[5, 6, 600, 7], [3, 630, 631, 8, 9]]
    with LLM(wide, **kwargs) as plain, LLM(wide, speculative_config={
            "model": str(narrow), "num_speculative_tokens": 3, "disable_by_batch_size": None}, **kwargs) as spec:
        assert tokens_and_text(spec.generate(prompts, greedy(16))) == tokens_and_text(plain.generate(prompts, greedy(16)))
        assert spec.engine.stats().spec_draft_tokens > 0


def test_every_draft_is_the_draft_models_own_greedy_continuation(make_pair, half_draft, monkeypatch):
    """Through rejections (about half the drafts), preemption, chunked catch-up and prefix
    hits, each fill's drafts equal what the draft model (transformers, from scratch)
    continues the sequence with: no stale or missing draft KV anywhere."""
    from transformers import LlamaForCausalLM

    plain, spec = make_pair(half_draft, k=3, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=16)
    made = []
    fill = DraftModelProposer.fill

    def spy(self, scheduled):
        fill(self, scheduled)
        made.extend((list(item.seq.token_ids), item.draft_token_ids) for item in scheduled if item.draft_token_ids)

    monkeypatch.setattr(DraftModelProposer, "fill", spy)
    got = spec.generate(TEXTS, greedy(40))
    assert tokens_and_text(got) == tokens_and_text(plain.generate(TEXTS, greedy(40)))
    spec.generate([p + o.outputs[0].text for p, o in zip(TEXTS, got)], greedy(8))  # prefix hits
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.block_manager.prefix_hits > 0
    assert 0.2 < rate(spec) < 0.9 and len(made) > 50
    reference = LlamaForCausalLM.from_pretrained(half_draft).eval()
    with torch.no_grad():
        for tokens, drafts in made:
            ids = list(tokens)
            for _ in drafts:  # greedy, through EOS (drafts do not stop at it)
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
            assert drafts == ids[len(tokens):], (len(tokens), drafts, ids[len(tokens):])


def test_draft_model_paths_fail_clearly_and_a_folder_of_weights_alone_drafts(tiny, tmp_path, caplog):
    with pytest.raises(ConfigError, match="draft model.*nowhere"):
        LLM(tiny, show_progress=False, num_kv_blocks=64,
            speculative_config={"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2})
    weights = tmp_path / "weights-alone"
    weights.mkdir()
    for f in tiny.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            (weights / f.name).write_bytes(f.read_bytes())
    with LLM(tiny, show_progress=False, num_kv_blocks=64, block_size=4, dtype="float32",
             speculative_config={"model": str(weights), "num_speculative_tokens": 2,
                                 "disable_by_batch_size": None}) as llm:
        llm.generate(TEXTS[:2], greedy(12))
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert "no tokenizer" in caplog.text


def test_placeholders_are_room_within_every_limit(make_pair, tiny):
    _, spec = make_pair(tiny, k=5)
    proposer = spec.engine.proposer
    seq = Sequence("r", None, list(range(3, 13)), SamplingParams(max_tokens=100), max_total_tokens=512)
    assert proposer.propose(seq) == [DRAFT_PLACEHOLDER] * 5
    seq.params = SamplingParams(max_tokens=3)
    assert proposer.propose(seq) == [DRAFT_PLACEHOLDER] * 2
    seq.params = SamplingParams(max_tokens=100)
    proposer.max_model_len = 12  # the draft's positions end at 11: drafts at 10 and 11 at most
    assert proposer.propose(seq) == [DRAFT_PLACEHOLDER] * 3
    proposer.max_model_len = 8
    assert proposer.propose(seq) == []


def test_tensor_parallel_target_with_an_unsharded_draft(make_pair, half_draft):
    plain, _ = make_pair(half_draft)
    expected = plain.generate(TEXTS[:4], greedy(24))
    with LLM(plain.engine.config.model.model, show_progress=False, num_kv_blocks=256, block_size=4,
             dtype="float32", tensor_parallel_size=2,
             speculative_config={"model": str(half_draft), "num_speculative_tokens": 3,
                                 "disable_by_batch_size": None}) as llm:
        assert tokens_and_text(llm.generate(TEXTS[:4], greedy(24))) == tokens_and_text(expected)
        assert_speculated(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_draft_model_speculation_equals_plain_decoding(tiny, half_draft):
    kwargs = dict(dtype="float32", device="cuda", num_kv_blocks=256, block_size=16, max_num_seqs=4,
                  show_progress=False)
    with LLM(tiny, **kwargs) as plain:
        expected = plain.generate(TEXTS, greedy(40), use_tqdm=False)
    spec = {"model": str(half_draft), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    with LLM(tiny, speculative_config=spec, **kwargs) as llm:
        assert tokens_and_text(llm.generate(TEXTS, greedy(40), use_tqdm=False)) == tokens_and_text(expected)
        assert_speculated(llm)
