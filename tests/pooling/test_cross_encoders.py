"""Cross-encoders and classifiers (BertForSequenceClassification, XLMRobertaForSequence-
Classification): a text pair is one prompt with its segments, its score the classifier's
logit through the checkpoint's activation; equal to transformers' logits."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.pooling.checkpoints import make_cross_encoder

QUERY = "What stores the KV cache?"
DOCS = ["Paged attention stores the KV cache", "The quick brown fox", "hello world", "def fibonacci(n)"]


def hf_logits(model, tokenizer, first, second=None) -> torch.Tensor:
    encoded = tokenizer(first, second, return_token_type_ids=True, return_tensors="pt")
    with torch.no_grad():
        return model(**encoded).logits[0]


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_transformers(tmp_path, kind):
    hf = make_cross_encoder(tmp_path, kind, TINY_CORPUS)
    with LLM(tmp_path, dtype="float32", show_progress=False, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.engine.pooler_config.task == "classify"
        outs = llm.score(QUERY, DOCS)
        for doc, out in zip(DOCS, outs):
            expected = torch.sigmoid(hf_logits(hf, llm.tokenizer, QUERY, doc)[0]).item()
            assert out.outputs.score == pytest.approx(expected, abs=1e-5)
            assert out.prompt_token_ids == list(llm.tokenizer(QUERY, doc).input_ids)
        pairwise = llm.score(DOCS[:2], DOCS[2:])
        assert [o.outputs.score for o in pairwise] == pytest.approx(
            [torch.sigmoid(hf_logits(hf, llm.tokenizer, a, b)[0]).item() for a, b in zip(DOCS[:2], DOCS[2:])], abs=1e-5)
        with pytest.raises(ValueError, match="this model classifies"):
            llm.embed(["hello"])


def test_segments_matter(tmp_path):
    """BERT's pair has segment 1 on its second text: scoring the pair as one text of
    segment 0 gives another logit (so the test above checks the segments)."""
    hf = make_cross_encoder(tmp_path, "bert", TINY_CORPUS)
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        encoded = llm.tokenizer(QUERY, DOCS[0], return_token_type_ids=True)
        assert set(encoded.token_type_ids) == {0, 1}
        with torch.no_grad():
            typed = hf(input_ids=torch.tensor([encoded.input_ids]),
                       token_type_ids=torch.tensor([encoded.token_type_ids])).logits[0, 0]
            untyped = hf(input_ids=torch.tensor([encoded.input_ids])).logits[0, 0]
        assert abs(typed - untyped) > 1e-3
        # the same ids as one text (segment 0 throughout); a lone label's probability is its sigmoid
        as_one_text = llm.classify([list(encoded.input_ids)])[0].outputs.probs
        assert as_one_text == pytest.approx([torch.sigmoid(untyped).item()], abs=1e-5)
        assert llm.score(QUERY, DOCS[0])[0].outputs.score == pytest.approx(torch.sigmoid(typed).item(), abs=1e-5)


def test_identity_activation_and_multi_label_classifiers(tmp_path):
    raw = make_cross_encoder(tmp_path / "raw", "bert", TINY_CORPUS,
                             sbert_ce_default_activation_function="torch.nn.modules.linear.Identity")
    with LLM(tmp_path / "raw", dtype="float32", show_progress=False) as llm:
        assert llm.score(QUERY, DOCS[1])[0].outputs.score == pytest.approx(
            hf_logits(raw, llm.tokenizer, QUERY, DOCS[1])[0].item(), abs=1e-5)
    three = make_cross_encoder(tmp_path / "three", "xlm-roberta", TINY_CORPUS, num_labels=3,
                               id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2})
    with LLM(tmp_path / "three", dtype="float32", show_progress=False) as llm:
        assert llm.engine.pooler_config.labels == ("neg", "neutral", "pos")
        outs = llm.classify(DOCS)
        for doc, out in zip(DOCS, outs):
            expected = torch.softmax(hf_logits(three, llm.tokenizer, doc), -1).tolist()
            assert out.outputs.probs == pytest.approx(expected, abs=1e-5) and out.outputs.num_classes == 3
        with pytest.raises(ValueError, match="one-label cross-encoder"):
            llm.score(QUERY, DOCS)


def test_classifier_refusals(tmp_path):
    from tessera.config import ConfigError

    make_cross_encoder(tmp_path, "bert", TINY_CORPUS)
    with pytest.raises(ConfigError, match="no LM head to generate with"):
        LLM(tmp_path, dtype="float32", show_progress=False, runner="generate")
    with pytest.raises(ConfigError, match="speculate"):
        LLM(tmp_path, dtype="float32", show_progress=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
