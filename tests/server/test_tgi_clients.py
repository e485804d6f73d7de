"""The TGI routes through TGI's own clients: `text_generation.Client` and
`huggingface_hub.InferenceClient`, over real HTTP on loopback."""
from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.errors import ValidationError

from tests.server.conftest import CHAT, MODEL_NAME, PROMPT

# text_generation 0.7 still calls pydantic's .dict()
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")


@pytest.fixture
def tgi(url) -> Client:
    return Client(url, timeout=30)


def _prompt_ids(url: str, text: str) -> list[int]:
    return [t["id"] for t in httpx.post(url + "/tokenize", json={"inputs": text}).json()]


def test_generate_details(tgi, url):
    out = tgi.generate(PROMPT, max_new_tokens=8, decoder_input_details=True, top_n_tokens=2)
    d = out.details
    assert d.generated_tokens == len(d.tokens) <= 8
    assert d.finish_reason.value in ("length", "eos_token")
    assert d.seed is None  # greedy
    # prefill: the prompt's tokens, the first with no logprob (nothing predicts it)
    assert [t.id for t in d.prefill] == _prompt_ids(url, PROMPT)
    assert "".join(t.text for t in d.prefill) == PROMPT
    assert d.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.prefill[1:])
    # tokens with logprobs; top_tokens: 2 alternatives per position, best first, and
    # greedy means the chosen token is the first of them
    assert all(t.logprob is not None and t.logprob <= 0 and not t.special for t in d.tokens)
    assert len(d.top_tokens) == len(d.tokens)
    for token, top in zip(d.tokens, d.top_tokens):
        assert len(top) == 2
        assert top[0].logprob >= top[1].logprob
        assert top[0].id == token.id and top[0].logprob == pytest.approx(token.logprob, abs=1e-6)
    assert d.best_of_sequences is None


def test_generate_stream_events(tgi):
    full = tgi.generate(PROMPT, max_new_tokens=8)
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=8, top_n_tokens=1))
    assert len(events) == full.details.generated_tokens
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert all(len(e.top_tokens) == 1 for e in events)
    last = events[-1]
    assert last.generated_text == full.generated_text
    assert last.details.finish_reason == full.details.finish_reason
    assert last.details.generated_tokens == full.details.generated_tokens


def _stop_case(tgi, server) -> tuple[str, str, int]:
    """(stop, the greedy text up to and including its first occurrence, tokens generated then):
    a stop string that is a whole token's text (decoded alone), first seen where that token ends."""
    ref = tgi.generate(PROMPT, max_new_tokens=16)
    assert ref.details.finish_reason.value == "length", "pick a prompt the tiny model does not end early"
    for k, token in enumerate(ref.details.tokens):
        stop = server.state.token_text(token.id)
        if k == 0 or len(stop) < 2 or not stop.isascii() or not stop.isprintable():
            continue
        prefix = tgi.generate(PROMPT, max_new_tokens=k + 1).generated_text
        if prefix.endswith(stop) and prefix.find(stop) == len(prefix) - len(stop):
            return stop, prefix, k + 1
    pytest.fail(f"no usable stop string in the greedy output {ref.generated_text!r}")


def test_stop_sequence_finish_reason(tgi, server):
    stop, upto, n = _stop_case(tgi, server)
    out = tgi.generate(PROMPT, max_new_tokens=16, stop_sequences=[stop])
    assert out.details.finish_reason.value == "stop_sequence"
    assert out.details.generated_tokens == n
    # Whatever the server does with the stop string itself, nothing after it is returned.
    assert out.generated_text in (upto, upto[:-len(stop)])
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=16, stop_sequences=[stop]))
    assert len(events) == n
    assert events[-1].details.finish_reason.value == "stop_sequence"
    assert events[-1].generated_text == out.generated_text


def test_stop_sequence_is_kept_in_generated_text_as_tgi_does(tgi, server):
    """TGI decodes every generated token, so generated_text ends with the stop sequence."""
    stop, upto, _ = _stop_case(tgi, server)
    out = tgi.generate(PROMPT, max_new_tokens=16, stop_sequences=[stop])
    assert out.generated_text == upto


def test_validation_error_raises_the_client_error(tgi):
    with pytest.raises(ValidationError, match="`top_p` must be > 0.0 and < 1.0"):
        tgi.generate(PROMPT, max_new_tokens=2, top_p=1.0)
    with pytest.raises(ValidationError, match="`top_k` must be strictly positive"):
        list(tgi.generate_stream(PROMPT, max_new_tokens=2, top_k=0))


def test_best_of(tgi):
    out = tgi.generate(PROMPT, max_new_tokens=6, best_of=2, do_sample=True)
    seqs = out.details.best_of_sequences
    assert len(seqs) == 1 and seqs[0].generated_tokens == len(seqs[0].tokens)
    # the answer is the more likely of the two
    def total(tokens):
        return sum(t.logprob for t in tokens)
    assert total(out.details.tokens) >= total(seqs[0].tokens) - 1e-4


def test_hub_text_generation_seed(url):
    hub = InferenceClient(base_url=url, timeout=30)
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.9, seed=7)
    a = hub.text_generation(PROMPT, **kw)
    b = hub.text_generation(PROMPT, **kw)
    c = hub.text_generation(PROMPT, **{**kw, "seed": 8})
    assert isinstance(a, str) and a == b
    assert a != c
    d = hub.text_generation(PROMPT, details=True, **kw)
    assert d.generated_text == a and d.details.seed == 7


def test_hub_chat_completion(url):
    hub = InferenceClient(base_url=url, timeout=30)
    out = hub.chat_completion(CHAT, model=MODEL_NAME, max_tokens=6, temperature=0, seed=1)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 6
    # the same greedy request through the openai-shaped raw route says the same
    raw = httpx.post(url + "/v1/chat/completions",
                     json={"messages": CHAT, "max_tokens": 6, "temperature": 0}).json()
    assert out.choices[0].message.content == raw["choices"][0]["message"]["content"]
    chunks = list(hub.chat_completion(CHAT, model=MODEL_NAME, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        out.choices[0].message.content


def test_sampling_reports_the_seed_it_used(tgi):
    first = tgi.generate(PROMPT, max_new_tokens=8, do_sample=True)
    seed = first.details.seed
    assert isinstance(seed, int)
    again = tgi.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=seed)
    assert again.details.seed == seed and again.generated_text == first.generated_text
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=8, do_sample=True, seed=seed))
    assert events[-1].details.seed == seed and events[-1].generated_text == first.generated_text


def test_return_full_text_stream(tgi):
    plain = tgi.generate(PROMPT, max_new_tokens=4).generated_text
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=4, return_full_text=True))
    assert events[-1].generated_text == PROMPT + plain


def test_watermark_parameter_marks_the_tokens(tgi, url, tiny_model_dir):
    """TGI's `watermark` reaches the sampler: the tokens are those the engine writes with
    its watermark on (the default gamma 0.5, delta 2) for the same seed, not the plain
    ones. (What the watermark does is tested in tests/sampling and tests/engine.)"""
    from tessera import LLM, SamplingParams

    prompt = _prompt_ids(url, PROMPT)
    with LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        def engine_tokens(watermark: bool) -> list[int]:
            params = SamplingParams(do_sample=True, seed=3, max_new_tokens=24, watermark=watermark)
            return llm.generate([prompt], params)[0].outputs[0].token_ids

        marked, plain = engine_tokens(True), engine_tokens(False)
    for flag, expected in ((True, marked), (False, plain)):
        out = tgi.generate(PROMPT, max_new_tokens=24, watermark=flag, do_sample=True, seed=3)
        assert [t.id for t in out.details.tokens] == expected
    assert marked != plain


@pytest.mark.parametrize("stream", [True, False])
def test_token_texts_keep_multibyte_characters_whole(tgi, stream):
    """A character that spans several byte tokens (the regex forces emoji and CJK) comes whole
    on the token that completes it, "" on the ones before, as TGI decodes: the token texts
    add up to the generated text, never with a replacement character in between."""
    grammar = {"type": "regex", "value": "(😀|中文|é){4}"}
    if stream:
        events = list(tgi.generate_stream(PROMPT, max_new_tokens=24, grammar=grammar))
        tokens, text = [e.token for e in events], events[-1].generated_text
    else:
        out = tgi.generate(PROMPT, max_new_tokens=24, grammar=grammar)
        tokens, text = out.details.tokens, out.generated_text
    assert len(text) >= 4 and not text.isascii() and "\ufffd" not in text
    pieces = [t.text for t in tokens if not t.special]
    assert "".join(pieces) == text
    assert len(pieces) > len(text)  # some characters took several tokens: their first ones are ""
    assert "" in pieces and not any("\ufffd" in p for p in pieces)


def test_clients_given_only_a_url_chat_with_the_served_model(tgi, url):
    """huggingface_hub sends model "dummy" and text_generation "tgi" (with every unset field
    as null); TGI ignores the model, and so does tessera for these placeholders."""
    hub = InferenceClient(base_url=url, timeout=30).chat_completion(CHAT, max_tokens=4, temperature=0)
    assert hub.model == MODEL_NAME and hub.usage.completion_tokens <= 4
    out = tgi.chat(messages=[{"role": "user", "content": CHAT[0]["content"]}], max_tokens=4, temperature=0.0)
    assert out.choices[0].message.content == hub.choices[0].message.content
    other = httpx.post(url + "/v1/chat/completions", json={"model": "other", "messages": CHAT, "max_tokens": 2})
    assert other.status_code == 404


def test_json_object_with_a_schema_is_constrained_as_tgi_aliases_it(url):
    import json as _json

    schema = {"type": "object", "properties": {"zz": {"type": "boolean"}}, "required": ["zz"],
              "additionalProperties": False}
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": CHAT, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object", "value": schema}}).json()
    assert set(_json.loads(chat["choices"][0]["message"]["content"])) == {"zz"}
    tgi = httpx.post(url + "/generate", timeout=60, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 40, "grammar": {"type": "json_object", "value": schema}}}).json()
    assert set(_json.loads(tgi["generated_text"])) == {"zz"}


def test_an_explicit_neutral_temperature_stays_greedy(tgi):
    greedy = tgi.generate(PROMPT, max_new_tokens=8)
    neutral = tgi.generate(PROMPT, max_new_tokens=8, temperature=1.0)
    seeded = tgi.generate(PROMPT, max_new_tokens=8, seed=5)
    assert neutral.generated_text == greedy.generated_text == seeded.generated_text
    assert neutral.details.seed is None and seeded.details.seed is None  # greedy: no seed reported


def test_truncate_may_equal_the_input_limit(url, server):
    limit = server.state.limits.max_input_tokens
    ok = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "truncate": limit}})
    assert ok.status_code == 200, ok.text
    over = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1,
                                                                                  "truncate": limit + 1}})
    assert over.status_code == 422
