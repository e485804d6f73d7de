"""A server speculating with n-gram drafts, or with a draft model, answers as a plain one
does: TGI (its own client, streamed token by token although a step may add several) and
OpenAI (streamed and not), and /metrics counts the drafts."""
from __future__ import annotations

import httpx
import openai
import pytest
from text_generation import Client

from tests.server.conftest import MODEL_NAME, start_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")

PROMPT = "Paged attention"  # greedy, the tiny model does not end it (EOS) early


SPECULATIVE_CONFIGS = {
    "ngram": {"num_speculative_tokens": 4, "prompt_lookup_min": 1},
    # the model drafting for itself: every draft is accepted (float32)
    "draft_model": {"model": "<self>", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", params=list(SPECULATIVE_CONFIGS))
def spec_server(request, tiny_model_dir):
    config = dict(SPECULATIVE_CONFIGS[request.param])
    if "model" in config:
        config["model"] = str(tiny_model_dir)
    running = start_server(tiny_model_dir, llm_kwargs={"speculative_config": config})
    yield running
    running.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_tgi_and_openai_answers_equal_a_plain_servers(spec_server, server):
    plain, spec = Client(server.url, timeout=60), Client(spec_server.url, timeout=60)
    expected = plain.generate(PROMPT, max_new_tokens=40, decoder_input_details=False)
    got = spec.generate(PROMPT, max_new_tokens=40)
    assert got.generated_text == expected.generated_text
    assert [t.id for t in got.details.tokens] == [t.id for t in expected.details.tokens]
    streamed = [r for r in spec.generate_stream(PROMPT, max_new_tokens=40)]
    assert [r.token.id for r in streamed] == [t.id for t in expected.details.tokens]
    assert streamed[-1].generated_text == expected.generated_text
    assert [r.details for r in streamed[:-1]] == [None] * (len(streamed) - 1)

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused")
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    assert completion.choices[0].text == expected.generated_text
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == expected.generated_text
    assert usage.completion_tokens == len(expected.details.tokens)

    drafts = _metric(spec_server.url, "tessera_spec_decode_num_draft_tokens_total")
    accepted = _metric(spec_server.url, "tessera_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert _metric(spec_server.url, "tessera_spec_decode_num_drafts_total") > 0
    spec_server.assert_idle()
