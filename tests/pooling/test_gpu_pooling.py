"""Embeddings and cross-encoder scores on a CUDA GPU (skipped without one): a decoder
embedder through the Triton prefill kernel, chunked, and a BERT encoder whose prompts
attend to themselves through the Triton kernel's key limits, against transformers on the
CPU in float32."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.pooling.checkpoints import make_cross_encoder, make_encoder
from tests.pooling.test_embeddings_engine import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ATOL = 1e-4  # float32 on both sides; TF32 is off in tessera's float32 GEMMs, reductions differ


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_decoder_embeddings_on_the_gpu(make_embedder, pooling):
    embedder = make_embedder("qwen3", pooling, True)
    batch = prompts(12, seed=21, lo=5, hi=60)
    with LLM(embedder.folder, dtype="float32", device="cuda", num_kv_blocks=128, max_num_batched_tokens=32,
             max_num_seqs=8, show_progress=False) as llm:
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, embedder.reference(ids), atol=ATOL, rtol=0)


def test_encoder_and_cross_encoder_on_the_gpu(tmp_path):
    encoder = make_encoder(tmp_path / "bert", "bert", "MEAN", True, TINY_CORPUS)
    batch = prompts(8, seed=22, lo=5, hi=100)
    batch = [[t % encoder.hf.config.vocab_size for t in p] for p in batch]
    with LLM(encoder.folder, dtype="float32", device="cuda", num_kv_blocks=128, show_progress=False) as llm:
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, encoder.reference(ids), atol=ATOL, rtol=0)
    hf = make_cross_encoder(tmp_path / "ce", "bert", TINY_CORPUS)
    with LLM(tmp_path / "ce", dtype="float32", device="cuda", num_kv_blocks=128, show_progress=False) as llm:
        docs = ["Paged attention stores the KV cache", "The quick brown fox"]
        for doc, out in zip(docs, llm.score("What stores the KV cache?", docs)):
            encoded = llm.tokenizer("What stores the KV cache?", doc, return_token_type_ids=True, return_tensors="pt")
            with torch.no_grad():
                expected = torch.sigmoid(hf(**encoded).logits[0, 0]).item()
            assert out.outputs.score == pytest.approx(expected, abs=ATOL)
