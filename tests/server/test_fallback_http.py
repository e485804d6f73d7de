"""A model served through the transformers fallback answers over real HTTP exactly as
transformers' greedy generate would, streaming and not, and frees its cache afterwards."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.models.parity import hf_generate, make_tiny
from tests.models.test_transformers_fallback import _olmo
from tests.server.conftest import PROMPT, start_server

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def olmo(tmp_path_factory, tiny_tokenizer_dir):
    config_cls, model_cls, overrides = _olmo()
    folder = tmp_path_factory.mktemp("olmo-http")
    hf = make_tiny(folder, tiny_tokenizer_dir, config_cls, model_cls, seed=11, **overrides)
    running = start_server(folder)
    yield running, hf
    running.stop()


def test_generate_and_stream_equal_transformers(olmo):
    running, hf = olmo
    tokenizer = running.engine.engine.tokenizer
    want = hf_generate(hf, tokenizer(PROMPT)["input_ids"], 12)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True,
                                             "decoder_input_details": False}}
    r = httpx.post(f"{running.url}/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want
    with httpx.stream("POST", f"{running.url}/generate_stream", json=body, timeout=30) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == want
    assert events[-1]["generated_text"] == r.json()["generated_text"]
    running.assert_idle()
