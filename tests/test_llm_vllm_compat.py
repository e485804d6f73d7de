"""Python API details that vLLM code relies on: LLM.chat's arguments (chat_template,
chat_template_kwargs, continue_final_message), get_tokenizer, gpu_memory_utilization and
SamplingParams(max_tokens=None)."""
from __future__ import annotations

import pytest

from tessera import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def llm(make_tiny_llama):
    folder, _ = make_tiny_llama()
    return LLM(folder, dtype="float32", num_kv_blocks=64, max_model_len=48, show_progress=False,
               gpu_memory_utilization=0.3)


def prompt_of(llm: LLM, text: str) -> list[int]:
    return list(llm.get_tokenizer()(text, add_special_tokens=False).input_ids)


def test_chat_takes_a_template_and_its_kwargs(llm):
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}|{% endfor %}"
    out = llm.chat([{"role": "user", "content": "fox"}], GREEDY, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "hello"})[0]
    assert out.prompt_token_ids == prompt_of(llm, "hello fox|")


def test_continue_final_message_leaves_it_open(llm):
    conversation = [{"role": "user", "content": "fox"}, {"role": "assistant", "content": "the quick"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt_token_ids == prompt_of(llm, "<s>user: fox\n<s>assistant: the quick")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)


def test_vllm_engine_arguments(llm):
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.engine.config.cache.memory_fraction == 0.3


def test_max_tokens_none_runs_until_the_context_is_full(llm):
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 48 - 4 and out.finish_reason == "length"


def test_a_chat_template_path_that_does_not_exist_is_an_error(make_tiny_llama, tmp_path):
    folder, _ = make_tiny_llama()
    with pytest.raises(ValueError, match="looks like a file path"):  # at start-up, before loading
        LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, chat_template=str(tmp_path / "no_such.jinja"))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    llm = LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, chat_template=str(template))
    assert llm.chat([{"role": "user", "content": "fox"}], GREEDY, use_tqdm=False)[0].prompt_token_ids == \
        prompt_of(llm, "fox")


def test_generation_config_sets_the_default_sampling(make_tiny_llama):
    """vLLM's --generation-config auto: the model's sampling values are the defaults of
    requests that leave them out; `vllm` ignores them."""
    import json

    folder, _ = make_tiny_llama()
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7}))
    llm = LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.95, 20, 7)
    _, params = llm._pair([[5, 6]], None)  # what generate runs without sampling_params
    assert params[0].temperature == 0.6 and params[0].top_k == 20
    plain = LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0


def test_openai_requests_take_the_generation_config_defaults():
    from tessera.server.openai_validation import sampling_params
    from tessera.server.protocol import ChatCompletionRequest

    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = sampling_params(body, 4, None, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0, top_k=5)
    params = sampling_params(given, 4, None, defaults=defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 5, 0.95)


def test_bad_words_follow_a_reused_sampling_params_object(llm):
    """The words are tokenized per request: changing them on a reused object takes effect."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=["qqqq"])
    free = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    words = [w for w in (tokenizer.decode([t]).strip() for t in free.token_ids) if len(w) >= 2 and w.isalpha()]
    assert words, free.text
    params.bad_words = [words[0]]
    banned = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].text
    assert words[0] in free.text and words[0] not in banned
    assert "bad_words_token_ids" not in repr(params)
