"""Decoder classifiers: *ForSequenceClassification checkpoints (a `score` projection of the
last token) and a causal LM scoring by two tokens' logits (Qwen3-Reranker's "no" / "yes"
through --pooler-config classifier_from_token); equal to transformers."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.config import ConfigError
from tessera.pooling.scoring import PairingError

QUERY = "<Query>: what stores the KV cache?\n"
DOCS = ["<Document>: Paged attention stores the KV cache", "<Document>: The quick brown fox",
        "<Document>: hello world"]
QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def save(model, folder, tokenizer_dir):
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classification_checkpoints(tmp_path, tiny_tokenizer_dir, num_labels):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(0)
    hf = Qwen3ForSequenceClassification(Qwen3Config(**QWEN3, num_labels=num_labels)).eval()
    with torch.no_grad():
        hf.score.weight.mul_(20.0)  # logits of order 1
    folder = save(hf, tmp_path, tiny_tokenizer_dir)
    with LLM(folder, dtype="float32", show_progress=False) as llm:
        config = llm.engine.pooler_config
        assert config.task == "classify" and config.pooling_type == "LAST" and len(config.labels) == num_labels
        pairs = [QUERY + doc for doc in DOCS]
        ids = [list(llm.tokenizer(p).input_ids) for p in pairs]
        with torch.no_grad():
            expected = [hf(torch.tensor([i])).logits[0] for i in ids]
        if num_labels == 1:
            outs = llm.score(QUERY, DOCS)  # a decoder's pair: the two texts' tokens in a row
            assert [o.prompt_token_ids for o in outs] == [list(llm.tokenizer(QUERY, d).input_ids) for d in DOCS]
            for out, doc in zip(outs, DOCS):
                with torch.no_grad():
                    logit = hf(torch.tensor([out.prompt_token_ids])).logits[0, 0]
                assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
        else:
            for out, logits in zip(llm.classify(ids), expected):
                assert out.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=1e-5)


def test_two_ranks_classify_as_one(tmp_path, tiny_tokenizer_dir):
    """A sequence-classification checkpoint under tensor parallelism: each rank holds its
    shard of the backbone and the whole score projection, the driver classifies. A causal LM
    scoring by two tokens too (its LM head split by vocabulary over the ranks: the tokens'
    columns are gathered once at load), tied embeddings or not."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(3)
    hf = Qwen3ForSequenceClassification(Qwen3Config(**QWEN3, num_labels=3)).eval()
    with torch.no_grad():
        hf.score.weight.mul_(20.0)
    folder = save(hf, tmp_path, tiny_tokenizer_dir)
    with LLM(folder, dtype="float32", show_progress=False, tensor_parallel_size=2) as llm:
        ids = [list(llm.tokenizer(QUERY + doc).input_ids) for doc in DOCS]
        outs = llm.classify(ids)
    for out, i in zip(outs, ids):
        with torch.no_grad():
            logits = hf(torch.tensor([i])).logits[0]
        assert out.outputs.probs == pytest.approx(torch.softmax(logits, -1).tolist(), abs=1e-5)
    for tied in (False, True):
        hf, scorer, tokenizer, no, yes = token_scorer(tmp_path / f"scorer-{tied}", tiny_tokenizer_dir, tied=tied)
        vocab = tokenizer.get_vocab()
        assert vocab[no] < QWEN3["vocab_size"] // 2 <= vocab[yes]
        with LLM(scorer, dtype="float32", show_progress=False, runner="pooling", tensor_parallel_size=2,
                 pooler_config={"classifier_from_token": [no, yes]}) as llm:
            outs = llm.score(QUERY, DOCS)
        for out in outs:
            with torch.no_grad():
                logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
            probs = torch.softmax(logits[[vocab[no], vocab[yes]]], -1)
            assert out.outputs.score == pytest.approx(probs[1].item(), abs=1e-5)


def test_classifier_from_tokens_is_qwen3_rerankers_score(tmp_path, tiny_tokenizer_dir):
    """The causal LM's own logits at the last token: score = sigmoid(logit["b"] - logit["a"]),
    i.e. P(b) among {a, b}; a query scored again reuses its cached prefix (last-token pooling)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    hf = Qwen3ForCausalLM(Qwen3Config(**QWEN3)).eval()
    folder = save(hf, tmp_path, tiny_tokenizer_dir)
    vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    no, yes = sorted(t for t in vocab if t.isalpha() and len(t) > 2)[:2]  # two whole-word tokens
    with LLM(folder, dtype="float32", show_progress=False, runner="pooling", block_size=4,
             pooler_config={"classifier_from_token": [no, yes]}) as llm:
        assert llm.engine.pooler_config.labels == ("score",)
        long_query = QUERY * 4
        outs = llm.score(long_query, DOCS[:1])
        assert llm.engine.block_manager.prefix_hits == 0
        outs += llm.score(long_query, DOCS[1:])  # the query's blocks are cached by now
        for out in outs:
            with torch.no_grad():
                logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
            probs = torch.softmax(logits[[vocab[no], vocab[yes]]], -1)
            assert out.outputs.score == pytest.approx(probs[1].item(), abs=1e-5)
        assert llm.engine.block_manager.prefix_hits > 0


def test_refusals(tmp_path, tiny_tokenizer_dir, make_tiny_llama):
    folder, _ = make_tiny_llama(seed=7)
    with pytest.raises(ConfigError, match="not tokens of the vocabulary"):
        LLM(folder, dtype="float32", show_progress=False, runner="pooling",
            pooler_config={"classifier_from_token": ["no-such-token", "<s>"]})
    with pytest.raises(ConfigError, match="goes alone"):
        LLM(folder, dtype="float32", show_progress=False, runner="pooling",
            pooler_config={"classifier_from_token": ["<s>", "</s>"], "normalize": False})


def token_scorer(tmp_path, tokenizer_dir, tied: bool = False):
    """A random Qwen3 causal LM (1024 positions: a templated pair is long) saved with the
    tiny tokenizer (`tied`: its LM head the embedding, as Qwen3-Reranker-0.6B's), and two
    tokens of it standing for "no" and "yes": a letter and a whole word, one in each half of
    the vocabulary (two ranks hold them apart)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3, "max_position_embeddings": 1024,
                                         "tie_word_embeddings": tied})).eval()
    folder = save(hf, tmp_path, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    letters = sorted((i, t) for t, i in tokenizer.get_vocab().items() if t.isalpha())
    half = QWEN3["vocab_size"] // 2
    no = next(t for i, t in letters if i < half)
    yes = next(t for i, t in reversed(letters) if i >= half and len(t) > 2)
    return hf, folder, tokenizer, no, yes


def test_reranking_over_http(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """`tessera serve --runner pooling --pooler-config '{"classifier_from_token": [...]}'`:
    /v1/rerank ranks the documents by the causal LM's pair scores."""
    import httpx

    from tests.server.conftest import start_server

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    hf, folder, tokenizer, no, yes = token_scorer(tmp_path, tiny_tokenizer_dir)
    vocab = tokenizer.get_vocab()
    running = start_server(folder, llm_kwargs={"runner": "pooling", "pooler_config": {"classifier_from_token": [no, yes]}})
    try:
        reply = httpx.post(f"{running.url}/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
        expected = []
        for doc in DOCS:
            with torch.no_grad():
                logits = hf(torch.tensor([tokenizer(QUERY, doc).input_ids])).logits[0, -1]
            expected.append(torch.softmax(logits[[vocab[no], vocab[yes]]], -1)[1].item())
        best_first = sorted(range(len(DOCS)), key=lambda i: -expected[i])
        assert [r["index"] for r in reply["results"]] == best_first
        assert [r["relevance_score"] for r in reply["results"]] == pytest.approx([expected[i] for i in best_first],
                                                                                abs=1e-5)
        running.assert_idle()
    finally:
        running.stop()


def test_a_score_template_writes_each_pair(tmp_path, tiny_tokenizer_dir):
    """--chat-template beside a classifier is vLLM's score template: each pair is the
    template's rendering of [query, document] messages (examples/qwen3_reranker.jinja, its
    instruction around them), scored by the same tokens' logits as transformers'; a pair
    rendered past the context is refused, and nothing else changes."""
    from pathlib import Path

    hf, folder, tokenizer, no, yes = token_scorer(tmp_path, tiny_tokenizer_dir)
    vocab = tokenizer.get_vocab()
    template = Path(__file__).parents[2] / "examples" / "qwen3_reranker.jinja"
    query, docs = "what stores the KV cache?", ["Paged attention stores it", "The quick brown fox"]
    with LLM(folder, dtype="float32", show_progress=False, runner="pooling", chat_template=str(template),
             pooler_config={"classifier_from_token": [no, yes]}, max_model_len=1024) as llm:
        assert llm.engine.pooler_config.pair_template is not None
        outs = llm.score(query, docs)
        for doc, out in zip(docs, outs):
            text = tokenizer.apply_chat_template([{"role": "query", "content": query}, {"role": "document", "content": doc}],
                                                 chat_template=template.read_text(), tokenize=False)
            assert f"<Query>: {query}\n<Document>: {doc}<|im_end|>" in text and text.endswith("</think>\n\n")
            assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
            with torch.no_grad():
                logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
            assert out.outputs.score == pytest.approx(torch.softmax(logits[[vocab[no], vocab[yes]]], -1)[1].item(),
                                                      abs=1e-5)
        with pytest.raises(PairingError, match="score template is .* tokens, over the limit of 1024"):
            llm.score(query, ["doc " * 1000])
    with LLM(folder, dtype="float32", show_progress=False, runner="pooling",
             pooler_config={"classifier_from_token": [no, yes]}) as llm:  # no template: the texts in a row
        out, = llm.score(query, docs[:1])
        assert out.prompt_token_ids == tokenizer(query, docs[0]).input_ids
