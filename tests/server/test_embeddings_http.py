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
