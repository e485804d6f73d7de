"""BERT-style encoders (BERT, XLM-RoBERTa) as embedding models: every token attends to its
whole prompt, as in transformers' BertModel; vectors equal transformers' pooled states."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tessera import LLM
from tessera.config import ConfigError
from tests.conftest import TINY_CORPUS
from tests.pooling.checkpoints import make_encoder

ATOL = 1e-5


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    made = {}

    def get(kind: str, pooling: str | None = "CLS", normalize: bool = True):
        key = (kind, pooling, normalize)
        if key not in made:
            made[key] = make_encoder(tmp_path_factory.mktemp(kind), kind, pooling, normalize, TINY_CORPUS)
        return made[key]

    return get


def token_prompts(count: int, vocab: int, seed: int, lo: int = 1, hi: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def check(embedder, llm: LLM, batch: list[list[int]]) -> None:
    for ids, out in zip(batch, llm.embed(batch)):
        torch.testing.assert_close(out.outputs.data, embedder.reference(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_encoders_equal_transformers(encoders, kind, pooling):
    embedder = encoders(kind, pooling)
    vocab = embedder.hf.config.vocab_size
    with LLM(embedder.folder, dtype="float32", show_progress=False) as llm:
        assert llm.engine.is_pooling and llm.engine.max_model_len == 128
        texts = ["Paged attention stores the KV cache", "hello world"]
        outs = llm.embed(texts)  # the tokenizer adds [CLS] and [SEP]
        for text, out in zip(texts, outs):
            ids = list(llm.tokenizer(text).input_ids)
            assert out.prompt_token_ids == ids and ids[0] == llm.tokenizer.cls_token_id
            torch.testing.assert_close(out.outputs.data, embedder.reference(ids), atol=ATOL, rtol=0)
        check(embedder, llm, token_prompts(10, vocab, seed=1, hi=128))


def test_a_prompt_is_never_split_and_never_reuses_a_prefix(encoders):
    """A 16-token step budget: each prompt (up to 128 tokens) still runs whole in one step,
    past the budget; a prompt sharing a cached prefix is computed from scratch."""
    embedder = encoders("bert", "MEAN")
    vocab = embedder.hf.config.vocab_size
    batch = token_prompts(6, vocab, seed=2, lo=40, hi=128)
    shared = batch[0][:-1] + [7]
    with LLM(embedder.folder, dtype="float32", show_progress=False, max_num_batched_tokens=16,
             max_num_seqs=4, block_size=8) as llm:
        engine = llm.engine
        steps = []
        original = engine.runner.execute

        def record(scheduled):
            steps.append([(item.seq.num_computed_tokens, item.num_new_tokens, item.seq.num_prompt_tokens)
                          for item in scheduled])
            return original(scheduled)

        engine.runner.execute = record
        check(embedder, llm, batch + [shared])
        assert all(start == 0 and n == total for step in steps for start, n, total in step)
        assert engine.block_manager.prefix_hits == 0


def test_bfloat16_and_refusals(encoders):
    embedder = encoders("bert", None)  # no sentence-transformers files: CLS, normalized
    batch = token_prompts(4, embedder.hf.config.vocab_size, seed=3, lo=10, hi=60)
    with LLM(embedder.folder, dtype="bfloat16", show_progress=False) as llm:
        assert llm.engine.pooler_config.pooling_type == "CLS" and llm.engine.pooler_config.normalize
        for ids, out in zip(batch, llm.embed(batch)):
            assert F.cosine_similarity(out.outputs.data, embedder.reference(ids), dim=0) >= 1 - 1e-3
    with pytest.raises(ConfigError, match="an encoder embeds text and cannot generate"):
        LLM(embedder.folder, dtype="float32", show_progress=False, runner="generate")


def test_truncation_keeps_the_special_tokens(encoders):
    """truncate_prompt_tokens cuts the text between [CLS] and [SEP], which CLS pooling reads."""
    from tessera.engine.request_checks import RequestError

    embedder = encoders("bert", "CLS")
    text = "Paged attention stores the KV cache in fixed-size blocks"
    with LLM(embedder.folder, dtype="float32", show_progress=False) as llm:
        ids = list(llm.tokenizer(text).input_ids)
        out, = llm.embed([text], truncate_prompt_tokens=6)
        kept = out.prompt_token_ids
        assert kept == [ids[0], *ids[-5:-1], ids[-1]] and kept[0] == llm.tokenizer.cls_token_id
        torch.testing.assert_close(out.outputs.data, embedder.reference(kept), atol=ATOL, rtol=0)
        with pytest.raises(RequestError, match="no room for the text"):
            llm.embed([text], truncate_prompt_tokens=2)
