"""How many prompt tokens the prefix cache held, as each API reports it: vLLM's
RequestOutput.num_cached_tokens, OpenAI's prompt_tokens_details.cached_tokens (chat and
completions with --enable-prompt-tokens-details, as vLLM; the Responses API always),
Anthropic's cache_read_input_tokens (apart from input_tokens)."""
from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME


def fresh_conversation() -> list[dict]:
    """A prompt of several KV blocks no earlier request has sent."""
    return [{"role": "user", "content": "Paged attention " + " ".join(uuid.uuid4().hex for _ in range(6))}]


def test_the_engine_counts_a_prompts_cached_tokens(make_tiny_llama):
    from tessera import LLM, SamplingParams

    folder, _ = make_tiny_llama()
    prompt = list(range(3, 3 + 40))  # two whole 16-token blocks and a part
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        params = SamplingParams(max_tokens=2, temperature=0)
        first, second = (llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for _ in range(2))
        fresh = list(range(100, 140))  # n=3 on a prompt never seen: its siblings reuse the first's blocks,
        several = llm.generate({"prompt_token_ids": fresh}, SamplingParams(max_tokens=2, n=3), use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert several.num_cached_tokens == 0 and len(several.outputs) == 3  # which the cache did not hold


def test_chat_and_completions_report_them_under_the_flag(url, server, monkeypatch):
    with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
        messages = fresh_conversation()
        plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
        assert plain.usage.prompt_tokens_details is None  # off by default, as in vLLM
        monkeypatch.setattr(server.state, "prompt_tokens_details", True)
        again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached <= again.usage.prompt_tokens and cached % 16 == 0
        chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
        other = fresh_conversation()
        assert client.chat.completions.create(model=MODEL_NAME, messages=other, max_tokens=2
                                              ).usage.prompt_tokens_details.cached_tokens == 0
        text = messages[0]["content"]
        first = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=2)
        both = client.completions.create(model=MODEL_NAME, prompt=[text + " again", text + " and again"],
                                         max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert both.usage.prompt_tokens_details.cached_tokens >= 2 * 16  # each prompt reuses the first's blocks
    server.assert_idle()


def test_responses_and_messages_always_report_them(url, server):
    messages = fresh_conversation()
    with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
        first = client.responses.create(model=MODEL_NAME, input=messages, max_output_tokens=2)
        second = client.responses.create(model=MODEL_NAME, input=messages, max_output_tokens=2)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert 0 < second.usage.input_tokens_details.cached_tokens <= second.usage.input_tokens
    with anthropic.Anthropic(base_url=url, api_key="-", max_retries=0) as client:
        msg = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=2)
        total = client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens
        assert msg.usage.cache_read_input_tokens > 0 and msg.usage.input_tokens + msg.usage.cache_read_input_tokens == total
        raw = httpx.post(url + "/v1/messages", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2,
                                                      "stream": True}).text
        start = raw.split("\n\n")[0].split("data: ", 1)[1]
        assert f'"cache_read_input_tokens": {msg.usage.cache_read_input_tokens}' in start
    server.assert_idle()


@pytest.fixture(autouse=True)
def _prefix_caching_on(server):
    assert server.engine.engine.config.cache.enable_prefix_caching
