"""Embedding models in the engine: pooled vectors equal transformers' on the same
checkpoint, however the prompt is scheduled (batched, chunked, preempted, after a prefix hit)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tessera import LLM
from tessera.engine.request_checks import RequestError
from tessera.pooling.params import PoolingParams, PoolingParamsError
from tessera.sampling.params import SamplingParams

# float32 on both sides: only the summation order differs (paged attention, packed GEMMs)
ATOL = 1e-5


def prompts(count: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def check_close(embedder, llm: LLM, batch: list[list[int]], **kwargs) -> None:
    outs = llm.embed(batch, **kwargs)
    assert [o.prompt_token_ids for o in outs] == batch
    for ids, out in zip(batch, outs):
        ref = embedder.reference(ids)
        assert out.outputs.data.dtype == torch.float32
        assert out.outputs.hidden_size == ref.shape[0]
        torch.testing.assert_close(out.outputs.data, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("pooling,normalize", [("LAST", True), ("MEAN", True), ("CLS", False)])
def test_pooled_vectors_equal_transformers(make_embedder, arch, pooling, normalize):
    embedder = make_embedder(arch, pooling, normalize)
    with LLM(embedder.folder, dtype="float32", show_progress=False) as llm:
        assert llm.engine.is_pooling  # a sentence-transformers folder pools without being told
        assert llm.engine.pooler_config.pooling_type == pooling
        assert llm.engine.model.lm_head is None
        check_close(embedder, llm, prompts(12, seed=1))


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_chunked_and_batched_prompts_pool_the_same(make_embedder, pooling):
    """8-token steps split every prompt over several steps, several prompts share a step."""
    embedder = make_embedder("qwen3", pooling, True)
    batch = prompts(16, seed=2, lo=9, hi=40)
    with LLM(embedder.folder, dtype="float32", show_progress=False, max_num_batched_tokens=8,
             max_num_seqs=8, block_size=4) as llm:
        check_close(embedder, llm, batch)
        assert llm.engine.block_manager.all_free()


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_a_preempted_prompt_pools_from_scratch(make_embedder, pooling):
    """Preempted halfway (as the scheduler preempts: blocks freed, recomputed from
    position 0), a prompt's pooling starts over instead of adding its first chunks twice."""
    embedder = make_embedder("qwen3", pooling, True)
    ids = prompts(1, seed=8, lo=40, hi=40)[0]
    with LLM(embedder.folder, dtype="float32", show_progress=False, max_num_batched_tokens=8,
             max_num_seqs=8) as llm:
        engine = llm.engine
        seq = engine.add_request("r", ids)
        assert engine.step() == [] and engine.step() == []
        assert seq.num_computed_tokens == 16 and seq.pooling.partial is not None
        engine.scheduler.running.remove(seq)
        engine.scheduler._preempt(seq)
        outputs = [out for out in engine.iter_outputs()]
        assert engine.scheduler.num_preemptions == 1 and len(outputs) == 1
        torch.testing.assert_close(outputs[0].outputs.data, embedder.reference(ids), atol=ATOL, rtol=0)


def test_last_token_pooling_reuses_cached_prefixes_and_mean_does_not(make_embedder):
    shared = prompts(1, seed=3, lo=40, hi=40)[0]
    batch = [shared + [7], shared + [9, 11]]
    for pooling, reuses in (("LAST", True), ("MEAN", False)):
        embedder = make_embedder("qwen3", pooling, True)
        with LLM(embedder.folder, dtype="float32", show_progress=False, block_size=8) as llm:
            check_close(embedder, llm, [batch[0]])
            before = llm.engine.block_manager.prefix_hits
            check_close(embedder, llm, [batch[1]])
            assert (llm.engine.block_manager.prefix_hits > before) == reuses


def test_generative_checkpoint_runs_as_embedding_model(make_tiny_llama):
    """--runner pooling on a causal LM checkpoint: its LM head is skipped, the backbone's
    last hidden state pooled (the same backbone transformers runs under the head)."""
    folder, hf = make_tiny_llama(seed=4)
    batch = prompts(5, seed=4)
    with LLM(folder, dtype="float32", show_progress=False) as llm:
        assert not llm.engine.is_pooling  # a causal LM generates unless told
    with LLM(folder, dtype="float32", show_progress=False, runner="pooling",
             pooler_config={"pooling_type": "mean", "normalize": False}) as llm:
        for ids, out in zip(batch, llm.embed(batch)):
            with torch.no_grad():
                hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
            torch.testing.assert_close(out.outputs.data, hidden.mean(0), atol=ATOL, rtol=0)


def test_request_options(make_embedder):
    embedder = make_embedder("qwen3", "LAST", True)
    ids = prompts(1, seed=5, lo=30, hi=30)[0]
    with LLM(embedder.folder, dtype="float32", show_progress=False,
             pooler_config={"is_matryoshka": True}) as llm:
        out, = llm.embed([ids], PoolingParams(dimensions=16))
        torch.testing.assert_close(out.outputs.data, embedder.reference(ids, dimensions=16), atol=ATOL, rtol=0)
        raw, = llm.embed([ids], PoolingParams(normalize=False))
        torch.testing.assert_close(raw.outputs.data, embedder.reference(ids, normalize=False), atol=ATOL, rtol=0)
        assert abs(raw.outputs.data.norm().item() - 1.0) > 1e-3
        cut, = llm.embed([ids], truncate_prompt_tokens=10)
        assert cut.prompt_token_ids == ids[-10:]
        torch.testing.assert_close(cut.outputs.data, embedder.reference(ids[-10:]), atol=ATOL, rtol=0)
        full = prompts(1, seed=6, lo=256, hi=256)[0]  # exactly max_model_len: no room to generate is fine
        assert len(llm.embed([full])[0].outputs.embedding) == 64
        with pytest.raises(RequestError, match="max_model_len"):
            llm.embed([full + [5]])
        with pytest.raises(RequestError, match="exceeds the model's embedding size"):
            llm.embed([ids], PoolingParams(dimensions=65))
        with pytest.raises(RequestError, match="generates no text"):
            llm.generate([ids], SamplingParams(max_tokens=2))
        assert llm.engine.block_manager.all_free() and not llm.engine.requests
    with LLM(embedder.folder, dtype="float32", show_progress=False) as llm:
        with pytest.raises(RequestError, match="Matryoshka"):
            llm.embed([ids], PoolingParams(dimensions=16))
    with pytest.raises(PoolingParamsError):
        PoolingParams(dimensions=0)
    with pytest.raises(PoolingParamsError):
        PoolingParams(truncate_prompt_tokens=0)


def test_embed_refused_by_a_generative_model(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=5)
    with LLM(folder, dtype="float32", show_progress=False) as llm:
        with pytest.raises(ValueError, match="needs an embedding model or a classifier"):
            llm.embed(["hello"])
        with pytest.raises(RequestError, match="generative model"):
            llm.engine.add_request("x", [3, 4], PoolingParams())


def test_bfloat16_embeddings_stay_close(make_embedder):
    """The CPU kernels in bf16: cosine similarity >= 1 - 1e-3 to float32 transformers (vLLM's
    check_embeddings_close)."""
    embedder = make_embedder("qwen3", "MEAN", True)
    batch = prompts(6, seed=7, lo=20, hi=60)
    with LLM(embedder.folder, dtype="bfloat16", show_progress=False) as llm:
        for ids, out in zip(batch, llm.embed(batch)):
            assert F.cosine_similarity(out.outputs.data, embedder.reference(ids), dim=0) >= 1 - 1e-3


def test_tensor_parallel_embeddings_equal_transformers(make_embedder):
    """Two ranks: each loads its shard of the bare backbone (no LM head either), the driver
    pools the all-reduced hidden states."""
    embedder = make_embedder("qwen3", "MEAN", True)
    with LLM(embedder.folder, dtype="float32", num_kv_blocks=64, show_progress=False,
             tensor_parallel_size=2) as llm:
        check_close(embedder, llm, prompts(6, seed=9))


def test_score_is_the_cosine_of_the_two_embeddings(make_embedder):
    embedder = make_embedder("qwen3", "LAST", False)
    first, second = prompts(2, seed=10), prompts(2, seed=11)
    with LLM(embedder.folder, dtype="float32", show_progress=False) as llm:
        one_to_many = llm.score(first[0], second)
        pairwise = llm.score(first, second)
        with pytest.raises(ValueError, match="as many as"):
            llm.score(first, second + first)
    ref = [embedder.reference(p) for p in first + second]
    assert [o.outputs.score for o in one_to_many] == pytest.approx(
        [F.cosine_similarity(ref[0], ref[2 + j], dim=0).item() for j in range(2)], abs=1e-5)
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [F.cosine_similarity(ref[i], ref[2 + i], dim=0).item() for i in range(2)], abs=1e-5)
    assert one_to_many[1].prompt_token_ids == first[0] + second[1]


def test_named_prompts(make_embedder, tiny_tokenizer_dir):
    """prompt_name puts the model's named prompt before each text (sentence-transformers' encode)."""
    prompts_ = {"query": "Instruct: find the passage\nQuery:", "document": ""}
    embedder = make_embedder("qwen3", "LAST", True, prompts=prompts_)
    with LLM(embedder.folder, dtype="float32", show_progress=False) as llm:
        out, = llm.embed(["what stores the KV cache?"], prompt_name="query")
        ids = list(llm.tokenizer(prompts_["query"] + "what stores the KV cache?").input_ids)
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(out.outputs.data, embedder.reference(ids), atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match="not one of the model's prompts"):
            llm.embed(["x"], prompt_name="passage")
        with pytest.raises(ValueError, match="text prompts"):
            llm.embed([[5, 6]], prompt_name="query")
