"""EuroBERT (Llama's layers attending both ways) as an embedding model and a classifier;
equal to transformers' EuroBertModel and EuroBertForSequenceClassification."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.pooling.checkpoints import nudge_norms_and_biases, write_sentence_transformers, write_wordpiece_tokenizer
from tests.pooling.test_encoders import token_prompts
from tests.pooling.test_modernbert import pooled

ATOL = 1e-5
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=3, mask_token_id=4)


def make_eurobert(folder, num_labels: int | None = None, pooling: str | None = None, **overrides):
    from transformers import EuroBertConfig, EuroBertForSequenceClassification, EuroBertModel

    vocab = write_wordpiece_tokenizer(folder, TINY_CORPUS)
    config = EuroBertConfig(vocab_size=vocab, **{**CONFIG, **overrides})
    torch.manual_seed(0)
    if num_labels is None:
        model = EuroBertModel(config)
    else:
        config.num_labels = num_labels
        model = EuroBertForSequenceClassification(config)
    nudge_norms_and_biases(model.eval(), 0, "norm", {"classifier": 20.0})
    model.save_pretrained(folder)
    if pooling is not None:
        write_sentence_transformers(folder, pooling, True)
    return model


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_eurobert_embeddings_equal_transformers(tmp_path, pooling):
    hf = make_eurobert(tmp_path, pooling=pooling)
    batch = token_prompts(6, hf.config.vocab_size, seed=1, hi=120)
    with LLM(tmp_path, dtype="float32", show_progress=False, max_num_batched_tokens=64) as llm:
        assert llm.engine.is_pooling
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, pooled(hf, ids, pooling), atol=ATOL, rtol=0)


@pytest.mark.parametrize("classifier_pooling", ["bos", "mean"])
def test_eurobert_classifier_equals_transformers(tmp_path, classifier_pooling):
    hf = make_eurobert(tmp_path, num_labels=3, classifier_pooling=classifier_pooling)
    batch = token_prompts(4, hf.config.vocab_size, seed=2, lo=5, hi=80)
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        for ids, out in zip(batch, llm.classify(batch)):
            with torch.no_grad():
                expected = torch.softmax(hf(torch.tensor([ids])).logits[0], -1).tolist()
            assert out.outputs.probs == pytest.approx(expected, abs=1e-5)


def test_late_pooling_is_refused(tmp_path):
    make_eurobert(tmp_path, num_labels=2, classifier_pooling="late")
    with pytest.raises(ValueError, match="classifier_pooling 'late'"):
        LLM(tmp_path, dtype="float32", show_progress=False)
