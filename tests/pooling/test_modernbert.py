"""ModernBERT encoders (embedders, cross-encoders and classifiers): pre-norm layers, rotary
positions at two thetas, and local layers that see a window on each side of a token; equal
to transformers' ModernBertModel and ModernBertForSequenceClassification."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera import LLM
from tessera.config import ConfigError
from tests.conftest import TINY_CORPUS
from tests.pooling.checkpoints import make_modernbert
from tests.pooling.test_encoders import token_prompts

ATOL = 1e-5
QUERY = "What stores the KV cache?"
DOCS = ["Paged attention stores the KV cache in fixed-size blocks", "The quick brown fox", "hello world",
        "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"]


def pooled(model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden[0] if pooling == "CLS" else hidden.mean(0)
    return F.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_modernbert_embeddings_equal_transformers(tmp_path, pooling):
    hf = make_modernbert(tmp_path, TINY_CORPUS, pooling, bias=True, norm_bias=True, attention_bias=True,
                         mlp_bias=True, classifier_bias=True)
    batch = token_prompts(10, hf.config.vocab_size, seed=1, hi=200)
    with LLM(tmp_path, dtype="float32", show_progress=False, max_num_batched_tokens=64) as llm:
        assert llm.engine.is_pooling and llm.engine.pooler_config.pooling_type == pooling
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, pooled(hf, ids, pooling), atol=ATOL, rtol=0)
        text, = llm.embed(DOCS[:1])  # the tokenizer adds [CLS] and [SEP]
        ids = list(llm.tokenizer(DOCS[0]).input_ids)
        assert text.prompt_token_ids == ids and ids[0] == llm.tokenizer.cls_token_id
        torch.testing.assert_close(text.outputs.data, pooled(hf, ids, pooling), atol=ATOL, rtol=0)


def test_the_local_window_is_two_sided_and_matters(tmp_path):
    """Vectors of long prompts differ from a model whose local layers see the whole prompt
    (so the parity above checks the window), and from one whose window looks only behind."""
    hf = make_modernbert(tmp_path, TINY_CORPUS, "MEAN")
    ids = token_prompts(1, hf.config.vocab_size, seed=4, lo=150, hi=150)[0]
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        ours = llm.embed([ids])[0].outputs.data
        local = [layer.attn.attn for layer in llm.engine.runner.model.model.layers if layer.local]
        assert local and all(a.lookahead == 8 and a.sliding_window == 9 for a in local)
        for attn in local:
            attn.lookahead = 0
        behind_only = llm.embed([ids])[0].outputs.data
    torch.testing.assert_close(ours, pooled(hf, ids, "MEAN"), atol=ATOL, rtol=0)
    assert (ours - behind_only).abs().max() > 1e-3
    hf.config.local_attention = 4096  # every layer global
    assert (ours - pooled(hf, ids, "MEAN")).abs().max() > 1e-3
    from tessera.ops.attention import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.zeros(5), block_tables=torch.zeros(2, 1), seq_lens=torch.tensor([9, 5]),
                             query_start_loc=torch.tensor([0, 1, 6]), num_decodes=1, num_decode_tokens=1,
                             seq_lens_list=[9, 5], query_lens_list=[1, 5], key_limits=torch.tensor([4] * 5))
    assert meta.within_lookahead(2).key_limits.tolist() == [2, 3, 4, 4, 4]
    assert meta.within_lookahead(2) is meta.within_lookahead(2) and meta.causal().within_lookahead(2).key_limits is None


@pytest.mark.parametrize("classifier_pooling", ["cls", "mean"])
def test_modernbert_cross_encoder_scores_equal_transformers(tmp_path, classifier_pooling):
    hf = make_modernbert(tmp_path, TINY_CORPUS, num_labels=1, classifier_pooling=classifier_pooling)
    with LLM(tmp_path, dtype="float32", show_progress=False, max_num_batched_tokens=32, max_num_seqs=3) as llm:
        config = llm.engine.pooler_config
        assert config.task == "classify" and config.pooling_type == classifier_pooling.upper()
        assert not config.pair_segments  # ModernBERT has no token types
        outs = llm.score(QUERY, DOCS)
        for doc, out in zip(DOCS, outs):
            encoded = llm.tokenizer(QUERY, doc, return_tensors="pt")
            assert out.prompt_token_ids == encoded.input_ids[0].tolist()
            with torch.no_grad():
                expected = torch.sigmoid(hf(input_ids=encoded.input_ids).logits[0, 0]).item()
            assert out.outputs.score == pytest.approx(expected, abs=1e-5)


def test_modernbert_classifier_labels_and_bfloat16(tmp_path):
    labels = {0: "neg", 1: "neutral", 2: "pos"}
    hf = make_modernbert(tmp_path, TINY_CORPUS, num_labels=3, classifier_pooling="mean", id2label=labels,
                         label2id={v: k for k, v in labels.items()})
    batch = token_prompts(5, hf.config.vocab_size, seed=5, lo=10, hi=120)
    with torch.no_grad():
        expected = [torch.softmax(hf(torch.tensor([ids])).logits[0], -1).tolist() for ids in batch]
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        assert llm.engine.pooler_config.labels == ("neg", "neutral", "pos")
        for out, probs in zip(llm.classify(batch), expected):
            assert out.outputs.probs == pytest.approx(probs, abs=1e-5)
    with LLM(tmp_path, dtype="bfloat16", show_progress=False) as llm:
        for out, probs in zip(llm.classify(batch), expected):
            assert out.outputs.probs == pytest.approx(probs, abs=3e-2)


def test_bfloat16_embeddings_and_refusals(tmp_path):
    hf = make_modernbert(tmp_path, TINY_CORPUS)  # no sentence-transformers files: CLS (classifier_pooling), normalized
    batch = token_prompts(4, hf.config.vocab_size, seed=3, lo=10, hi=120)
    with LLM(tmp_path, dtype="bfloat16", show_progress=False) as llm:
        assert llm.engine.pooler_config.pooling_type == "CLS" and llm.engine.pooler_config.normalize
        for ids, out in zip(batch, llm.embed(batch)):
            assert F.cosine_similarity(out.outputs.data, pooled(hf, ids, "CLS"), dim=0) >= 1 - 1e-3
    with pytest.raises(ConfigError, match="an encoder embeds text and cannot generate"):
        LLM(tmp_path, dtype="float32", show_progress=False, runner="generate")


@pytest.mark.parametrize("num_labels", [None, 2])
def test_inspect_loads_encoder_checkpoints(tmp_path, num_labels):
    """A bare ModernBertModel checkpoint and a classifier's (model., head., classifier.)
    load in `tessera inspect` as in the engine: every tensor lands."""
    from tessera.config import ModelConfig
    from tessera.inspection import format_report, inspect_model

    make_modernbert(tmp_path, TINY_CORPUS, num_labels=num_labels)
    info = inspect_model(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert info["router"] == "ModernBertRouter" and info["config"]["max_model_len"] == 512
    assert "ModernBertFor" in format_report(info)
