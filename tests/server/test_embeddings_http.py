"""Embeddings over real HTTP with real clients: OpenAI's /v1/embeddings (the openai SDK, which
asks for base64 by default), TEI's /embed and huggingface_hub's feature_extraction; the
vectors equal transformers' on the same tiny checkpoint."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.server.conftest import MODEL_NAME, start_server

ATOL = 1e-5
TEXTS = ["Paged attention stores the KV cache", "The quick brown fox", "hello"]
PROMPTS = {"query": "Instruct: find the passage\nQuery:", "document": ""}


@pytest.fixture(scope="module")
def embedder(make_embedder):
    return make_embedder("qwen3", "MEAN", True, prompts=PROMPTS)


@pytest.fixture(scope="module")
def embed_server(embedder):
    running = start_server(embedder.folder, max_concurrent_requests=8)
    yield running
    running.stop()


@pytest.fixture
def server(embed_server):
    yield embed_server
    embed_server.assert_idle()


def ids_of(server, text: str) -> list[int]:
    return list(server.state.tokenizer(text).input_ids)


def close(got, expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(np.asarray(got), dtype=torch.float32), expected, atol=ATOL, rtol=0)


def test_openai_client(server, embedder):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    reply = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # base64 on the wire
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == MODEL_NAME
    for text, item in zip(TEXTS, reply.data):
        close(item.embedding, embedder.reference(ids_of(server, text)))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(ids_of(server, t)) for t in TEXTS)
    floats = client.embeddings.create(model=MODEL_NAME, input="hello", encoding_format="float")
    close(floats.data[0].embedding, embedder.reference(ids_of(server, "hello")))
    tokens = [[5, 6, 7, 8], [9, 10]]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=tokens, encoding_format="float")
    for ids, item in zip(tokens, by_ids.data):
        close(item.embedding, embedder.reference(ids))


def test_wire_format(server, embedder):
    body = {"input": [11, 12, 13], "encoding_format": "base64"}
    reply = httpx.post(f"{server.url}/v1/embeddings", json=body).json()
    assert reply["object"] == "list" and reply["id"].startswith("embd-")
    item, = reply["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    close(decoded, embedder.reference([11, 12, 13]))
    plain = httpx.post(f"{server.url}/v1/embeddings", json={"input": [11, 12, 13], "encoding_format": None,
                                                            "normalize": False}).json()
    close(plain["data"][0]["embedding"], embedder.reference([11, 12, 13], normalize=False))
    cut = httpx.post(f"{server.url}/v1/embeddings", json={"input": list(range(3, 40)),
                                                          "truncate_prompt_tokens": 5}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    close(cut["data"][0]["embedding"], embedder.reference(list(range(35, 40))))


@pytest.mark.parametrize("body,status,param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["a", []]}, 400, None),
    ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": "hi", "encoding_format": "bytes"}, 400, None),
    ({"input": [600]}, 400, None),
    ({"input": list(range(3, 300))}, 400, None),
])
def test_openai_refusals(server, body, status, param):
    reply = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_tei_embed(server, embedder):
    one = httpx.post(f"{server.url}/embed", json={"inputs": "hello"}).json()
    assert len(one) == 1
    close(one[0], embedder.reference(ids_of(server, "hello")))
    many = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS, "normalize": False}).json()
    for text, vector in zip(TEXTS, many):
        close(vector, embedder.reference(ids_of(server, text), normalize=False))
    long = list(range(3, 300))  # max_model_len is 256
    refused = httpx.post(f"{server.url}/embed", json={"inputs": [long]})
    assert refused.status_code == 413
    assert refused.json()["error_type"] == "validation" and "256" in refused.json()["error"]
    right = httpx.post(f"{server.url}/embed", json={"inputs": [long], "truncate": True}).json()
    close(right[0], embedder.reference(long[:256]))
    left = httpx.post(f"{server.url}/embed", json={"inputs": [long], "truncate": True,
                                                   "truncation_direction": "Left"}).json()
    close(left[0], embedder.reference(long[-256:]))
    named = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS[:2], "prompt_name": "query"}).json()
    for text, vector in zip(TEXTS, named):  # sentence-transformers' encode(prompt_name="query")
        close(vector, embedder.reference(ids_of(server, PROMPTS["query"] + text)))
    for body in ({"inputs": "hi", "prompt_name": "passage"}, {"inputs": [5, 6], "prompt_name": "query"}):
        refused = httpx.post(f"{server.url}/embed", json=body)
        assert refused.status_code == 422 and "prompt_name" in refused.json()["error"]


def test_huggingface_hub_feature_extraction(server, embedder):
    from huggingface_hub import InferenceClient

    vector = InferenceClient(base_url=server.url).feature_extraction("The quick brown fox")
    close(vector.reshape(-1), embedder.reference(ids_of(server, "The quick brown fox")))


def test_a_large_batch_enters_in_waves(server, embedder):
    """300 inputs through a server that admits 8 requests at once: all answered, in order."""
    batch = [[3 + i % 200, 4 + i % 7, 5] for i in range(300)]
    reply = httpx.post(f"{server.url}/v1/embeddings", json={"input": batch, "encoding_format": "float"},
                       timeout=120).json()
    assert [d["index"] for d in reply["data"]] == list(range(300))
    for ids, item in list(zip(batch, reply["data"]))[::37]:
        close(item["embedding"], embedder.reference(ids))


def test_generation_routes_are_refused(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}]})):
        reply = httpx.post(f"{server.url}{path}", json=body)
        assert reply.status_code == 400 and "embedding model" in reply.json()["error"]["message"]
    reply = httpx.post(f"{server.url}/generate", json={"inputs": "hi"})
    assert reply.status_code == 422 and "embedding model" in reply.json()["error"]


def test_info_says_what_is_served(server):
    info = httpx.get(f"{server.url}/info").json()
    assert info["model_pipeline_tag"] == "feature-extraction"
    assert info["max_input_tokens"] == info["max_total_tokens"] == 256


def test_metrics_count_embedding_requests(server):
    before = httpx.get(f"{server.url}/metrics").text
    httpx.post(f"{server.url}/v1/embeddings", json={"input": [[5, 6, 7]]})
    after = httpx.get(f"{server.url}/metrics").text

    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    assert value(after, "tessera_prompt_tokens_total") - value(before, "tessera_prompt_tokens_total") == 3
    success = 'tessera_requests_total{outcome="success"}'
    assert value(after, success) - value(before, success) == 1


def test_a_generative_model_refuses_embeddings(shared_server):
    reply = httpx.post(f"{shared_server.url}/v1/embeddings", json={"input": "hi"})
    assert reply.status_code == 400
    assert "does not support the Embeddings API" in reply.json()["error"]["message"]
    reply = httpx.post(f"{shared_server.url}/embed", json={"inputs": "hi"})
    assert reply.status_code == 422 and reply.json()["error_type"] == "validation"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def test_score(server, embedder):
    refs = {t: embedder.reference(ids_of(server, t)) for t in TEXTS}
    one_to_many = httpx.post(f"{server.url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert one_to_many["object"] == "list" and one_to_many["id"].startswith("score-")
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    for text, item in zip(TEXTS, one_to_many["data"]):
        assert item["object"] == "score" and item["score"] == pytest.approx(cosine(refs[TEXTS[0]], refs[text]), abs=1e-5)
    assert one_to_many["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert one_to_many["usage"]["prompt_tokens"] == sum(len(ids_of(server, t)) for t in [TEXTS[0], *TEXTS])
    pairwise = httpx.post(f"{server.url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [cosine(refs[TEXTS[0]], refs[TEXTS[1]]), cosine(refs[TEXTS[1]], refs[TEXTS[2]])], abs=1e-5)
    mismatched = httpx.post(f"{server.url}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert mismatched.status_code == 400 and "as many as" in mismatched.json()["error"]["message"]


def test_rerank(server, embedder):
    query, docs = "The quick brown fox", [TEXTS[0], "The quick brown fox", TEXTS[2]]
    expected = [cosine(embedder.reference(ids_of(server, query)), embedder.reference(ids_of(server, d))) for d in docs]
    best_first = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, "query": query, "documents": docs}).json()
        assert reply["id"].startswith("rerank-") and reply["usage"]["total_tokens"] > 0
        assert [r["index"] for r in reply["results"]] == best_first == [1, *best_first[1:]]
        assert [r["relevance_score"] for r in reply["results"]] == pytest.approx([expected[i] for i in best_first], abs=1e-5)
        assert [r["document"]["text"] for r in reply["results"]] == [docs[i] for i in best_first]
    top = httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                       "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == best_first[:2] and "document" not in top["results"][0]
    tei = httpx.post(f"{server.url}/rerank", json={"query": query, "texts": docs, "return_text": True}).json()
    assert [(r["index"], r["text"]) for r in tei] == [(i, docs[i]) for i in best_first]
    assert [r["score"] for r in tei] == pytest.approx([expected[i] for i in best_first], abs=1e-5)
    empty = httpx.post(f"{server.url}/rerank", json={"query": query, "texts": []})
    assert empty.status_code == 422 and empty.json()["error_type"] == "validation"
    empty = httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_an_encoder_served(tmp_path, monkeypatch):
    """A BERT checkpoint: the TEI and OpenAI routes answer with transformers' CLS vectors."""
    from tests.conftest import TINY_CORPUS
    from tests.pooling.checkpoints import make_encoder

    bert = make_encoder(tmp_path, "bert", "CLS", True, TINY_CORPUS)
    running = start_server(bert.folder, max_concurrent_requests=8)
    try:
        text = "Paged attention stores the KV cache"
        ids = ids_of(running, text)
        close(httpx.post(f"{running.url}/embed", json={"inputs": text}).json()[0], bert.reference(ids))
        reply = httpx.post(f"{running.url}/v1/embeddings", json={"input": [text], "encoding_format": "float"}).json()
        close(reply["data"][0]["embedding"], bert.reference(ids))
        assert httpx.post(f"{running.url}/generate", json={"inputs": text}).status_code == 422
        running.assert_idle()
    finally:
        running.stop()


def test_a_cross_encoder_served(tmp_path):
    """A BERT cross-encoder: /rerank (vLLM's and TEI's), /score and /classify read each pair
    as one prompt; its embeddings route is refused."""
    from tests.conftest import TINY_CORPUS
    from tests.pooling.checkpoints import make_cross_encoder

    hf = make_cross_encoder(tmp_path, "bert", TINY_CORPUS)
    running = start_server(tmp_path, max_concurrent_requests=8)
    try:
        tokenizer = running.state.tokenizer
        query, docs = "What stores the KV cache?", TEXTS

        def logit(a: str, b: str) -> float:
            encoded = tokenizer(a, b, return_token_type_ids=True, return_tensors="pt")
            with torch.no_grad():
                return hf(**encoded).logits[0, 0].item()

        logits = [logit(query, d) for d in docs]
        best_first = sorted(range(len(docs)), key=lambda i: -logits[i])
        reply = httpx.post(f"{running.url}/v1/rerank", json={"query": query, "documents": docs}).json()
        assert [r["index"] for r in reply["results"]] == best_first
        assert [r["relevance_score"] for r in reply["results"]] == pytest.approx(
            [torch.sigmoid(torch.tensor(logits[i])).item() for i in best_first], abs=1e-5)
        tei = httpx.post(f"{running.url}/rerank", json={"query": query, "texts": docs, "raw_scores": True}).json()
        assert [(r["index"], r["score"]) for r in tei] == [(i, pytest.approx(logits[i], abs=1e-5)) for i in best_first]
        scored = httpx.post(f"{running.url}/score", json={"text_1": query, "text_2": docs[0]}).json()
        assert scored["data"][0]["score"] == pytest.approx(torch.sigmoid(torch.tensor(logits[0])).item(), abs=1e-5)
        assert httpx.get(f"{running.url}/info").json()["model_pipeline_tag"] == "text-classification"
        classified = httpx.post(f"{running.url}/classify", json={"input": docs[:2]}).json()
        assert classified["data"][0]["num_classes"] == 1  # a lone label: the sigmoid of its logit
        for text, item in zip(docs[:2], classified["data"]):
            with torch.no_grad():
                alone = hf(**tokenizer(text, return_token_type_ids=True, return_tensors="pt")).logits[0, 0]
            assert item["probs"] == pytest.approx([torch.sigmoid(alone).item()], abs=1e-5)
        predicted = httpx.post(f"{running.url}/predict", json={"inputs": [query, docs[0]]}).json()
        assert predicted == [{"score": pytest.approx(torch.sigmoid(torch.tensor(logits[0])).item(), abs=1e-5),
                              "label": "LABEL_0"}]
        batch = httpx.post(f"{running.url}/predict", json={"inputs": [[query, d] for d in docs],
                                                           "raw_scores": True}).json()
        assert [b[0]["score"] for b in batch] == pytest.approx(logits, abs=1e-5)
        refused = httpx.post(f"{running.url}/v1/embeddings", json={"input": "hi"})
        assert refused.status_code == 400 and "classifier" in refused.json()["error"]["message"]
        running.assert_idle()
    finally:
        running.stop()


def test_a_conversation_embedded(server, embedder):
    """vLLM's chat embedding request: `messages` rendered by the chat template (no generation
    prompt unless asked), its special tokens the template's own."""
    messages = [{"role": "user", "content": "Paged attention"}, {"role": "assistant", "content": "stores blocks"}]
    tokenizer = server.state.tokenizer
    for extra in ({}, {"add_generation_prompt": True}):
        text = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        reply = httpx.post(f"{server.url}/v1/embeddings", json={"messages": messages, "encoding_format": "float",
                                                                **extra}).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
        close(reply["data"][0]["embedding"], embedder.reference(ids))
    both = httpx.post(f"{server.url}/v1/embeddings", json={"messages": messages, "input": "x"})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def test_a_label_classifier_served(tmp_path):
    """TEI's /predict and vLLM's /classify on a three-label classifier: softmax over the labels."""
    from tests.conftest import TINY_CORPUS
    from tests.pooling.checkpoints import make_cross_encoder

    labels = {0: "neg", 1: "neutral", 2: "pos"}
    hf = make_cross_encoder(tmp_path, "xlm-roberta", TINY_CORPUS, num_labels=3, id2label=labels,
                            label2id={v: k for k, v in labels.items()})
    running = start_server(tmp_path, max_concurrent_requests=8)
    try:
        text = "I loved the quick brown fox"
        with torch.no_grad():
            probs = torch.softmax(hf(**running.state.tokenizer(text, return_tensors="pt")).logits[0], -1).tolist()
        predicted = httpx.post(f"{running.url}/predict", json={"inputs": text}).json()
        order = sorted(range(3), key=lambda i: -probs[i])
        assert [p["label"] for p in predicted] == [labels[i] for i in order]
        assert [p["score"] for p in predicted] == pytest.approx([probs[i] for i in order], abs=1e-5)
        classified = httpx.post(f"{running.url}/v1/classify", json={"input": [text]}).json()["data"][0]
        assert classified["label"] == labels[order[0]] and classified["probs"] == pytest.approx(probs, abs=1e-5)
        assert httpx.post(f"{running.url}/predict", json={"inputs": []}).status_code == 422
        running.assert_idle()
    finally:
        running.stop()


def test_truncation_and_long_pairs_over_http(tmp_path):
    """TEI's truncate keeps [CLS] / [SEP]; a cross-encoder pair longer than the context is cut
    to fit (the longer text first, as sentence-transformers' CrossEncoder does), one cut too
    short to hold its texts is a 400, never a 500; POST / of a classifier server is TEI's
    /predict."""
    from tests.conftest import TINY_CORPUS
    from tests.pooling.checkpoints import make_cross_encoder, make_encoder

    bert = make_encoder(tmp_path / "bert", "bert", "CLS", True, TINY_CORPUS)
    running = start_server(bert.folder, max_concurrent_requests=8)
    try:
        text = "hello world " * 80  # over the 128-token context
        ids = ids_of(running, text)
        for direction, kept in (("Right", ids[:127] + ids[-1:]), ("Left", ids[:1] + ids[-128:][1:])):
            vector = httpx.post(f"{running.url}/embed", json={"inputs": text, "truncate": True,
                                                               "truncation_direction": direction}).json()[0]
            assert len(kept) == 128 and kept[0] == running.state.tokenizer.cls_token_id
            close(vector, bert.reference(kept))
    finally:
        running.stop()
    make_cross_encoder(tmp_path / "ce", "bert", TINY_CORPUS)
    running = start_server(tmp_path / "ce", max_concurrent_requests=8)
    try:
        long_query = "hello world " * 80
        fitted = httpx.post(f"{running.url}/score", json={"text_1": long_query, "text_2": "the fox"})
        assert fitted.status_code == 200 and fitted.json()["usage"]["prompt_tokens"] == 128
        reply = httpx.post(f"{running.url}/score", json={"text_1": "a query", "text_2": "the fox",
                                                         "truncate_prompt_tokens": 3})
        assert reply.status_code == 400 and "no room" in reply.json()["error"]["message"]
        reply = httpx.post(f"{running.url}/predict", json={"inputs": [long_query, "the fox"], "truncate": True})
        assert reply.status_code in (200, 422), reply.text
        root = httpx.post(f"{running.url}/", json={"inputs": "the quick brown fox"}).json()
        assert root[0]["label"] == "LABEL_0" and 0 < root[0]["score"] < 1
        running.assert_idle()
    finally:
        running.stop()


def test_concurrent_large_batches_all_succeed(embedder):
    """Three 60-input requests at once through a server that admits 4 engine requests: they
    wait at the gate, none fails with 429."""
    import concurrent.futures

    running = start_server(embedder.folder, max_concurrent_requests=4)
    try:
        body = {"input": [[5 + i % 50, 6, 7] for i in range(60)], "encoding_format": "float"}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{running.url}/v1/embeddings", json=body,
                                                       timeout=120).status_code, range(3)))
        assert codes == [200, 200, 200]
        running.assert_idle()
    finally:
        running.stop()
