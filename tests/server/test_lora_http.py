"""LoRA adapters over HTTP: OpenAI clients pick one by `model`, TGI requests by `adapter_id`;
/v1/models lists them; vLLM's runtime load/unload routes; requests of different adapters
running at once each get what their adapter alone gives (the offline engine's answer)."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from text_generation import Client

from tessera import LLM, SamplingParams
from tessera.lora import LoRARequest
from tests.lora.peft_adapters import save_peft_adapter
from tests.server.conftest import MODEL_NAME, start_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")

PROMPT = "Paged attention"
MAX_TOKENS = 12


def save_adapter(hf_model, folder, seed: int, targets: list[str]) -> str:
    save_peft_adapter(hf_model, folder, seed, target_modules=targets)
    return str(folder)


@pytest.fixture(scope="module")
def setup(make_tiny_llama, tmp_path_factory):
    folder, hf_model = make_tiny_llama()
    root = tmp_path_factory.mktemp("adapters")
    paths = {"alpha": save_adapter(hf_model, root / "alpha", 1, ["q_proj", "v_proj", "down_proj"]),
             "beta": save_adapter(hf_model, root / "beta", 2, ["k_proj", "o_proj", "gate_proj", "up_proj"])}
    # what each adapter (and the base) answers alone, from the offline engine
    with LLM(folder, dtype="float32", num_kv_blocks=256, show_progress=False, enable_lora=True) as llm:
        params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        expected = {name: llm.generate(PROMPT, params, lora_request=LoRARequest(name, i + 1, path))[0].outputs[0].text
                    for i, (name, path) in enumerate(paths.items())}
        expected[None] = llm.generate(PROMPT, params)[0].outputs[0].text
    assert len(set(expected.values())) == 3, "the adapters must change the output for this test to mean anything"
    running = start_server(folder, allow_runtime_lora_updating=True,
                           llm_kwargs={"enable_lora": True, "max_loras": 2, "lora_modules": {"alpha": paths["alpha"]}})
    yield running, paths, expected
    running.stop()


def _complete(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def test_openai_model_and_tgi_adapter_id_pick_the_adapter(setup):
    running, paths, expected = setup
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL_NAME, "alpha"}
    assert listed["alpha"].parent == MODEL_NAME and listed["alpha"].root == paths["alpha"]

    got = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected["alpha"] and got.model == "alpha"
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert base.choices[0].text == expected[None]
    streamed = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["alpha"]
    assert {c.model for c in chunks} == {"alpha"}

    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_TOKENS, "adapter_id": "alpha"}}
    r = httpx.post(running.url + "/generate", json=tgi, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"] == expected["alpha"]
    events = httpx.post(running.url + "/generate_stream", json=tgi, timeout=60).text
    last = json.loads([line for line in events.splitlines() if line.startswith("data:")][-1][5:])
    assert last["generated_text"] == expected["alpha"]
    # the served model's name, or no adapter, is the base model
    assert Client(running.url).generate(PROMPT, max_new_tokens=MAX_TOKENS).generated_text == expected[None]
    r = httpx.post(running.url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": MAX_TOKENS, "adapter_id": MODEL_NAME}}, timeout=60)
    assert r.json()["generated_text"] == expected[None]
    running.assert_idle()


def test_unknown_adapters_are_refused_with_what_is_served(setup):
    running, _, _ = setup
    r = httpx.post(running.url + "/v1/completions", json={"model": "gamma", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
    assert "`gamma` does not exist" in r.json()["error"]["message"] and "`alpha`" in r.json()["error"]["message"]
    r = httpx.post(running.url + "/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "gamma"}})
    assert r.status_code == 422 and "'gamma'" in r.json()["error"] and "alpha" in r.json()["error"]
    running.assert_idle()


def test_runtime_load_and_unload(setup, tmp_path):
    running, paths, expected = setup
    url = running.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": paths["beta"]}, timeout=60)
    assert r.status_code == 200 and "beta" in r.text
    assert {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]} == {MODEL_NAME, "alpha", "beta"}
    assert _complete(url, "beta") == expected["beta"]

    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": paths["beta"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 8}')
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_model.safetensors" in bad.json()["error"]["message"]
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]

    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert r.status_code == 200
    assert httpx.post(url + "/v1/completions", json={"model": "beta", "prompt": PROMPT}).status_code == 404
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    running.assert_idle()


def test_concurrent_requests_of_different_adapters_each_get_their_own(setup):
    running, paths, expected = setup
    httpx.post(running.url + "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": paths["beta"]})
    # alpha, beta and the base model in flight at once: steps run rows of all three
    models = ["alpha", "beta", MODEL_NAME] * 3
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: _complete(running.url, m), models))
    assert texts == [expected[{"alpha": "alpha", "beta": "beta"}.get(m)] for m in models]
    metrics = httpx.get(running.url + "/metrics").text
    assert 'tessera_lora_requests_info{max_lora="2"' in metrics
    httpx.post(running.url + "/v1/unload_lora_adapter", json={"lora_name": "beta"})
    running.assert_idle()


def test_runtime_updates_need_the_flag(server):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404
    r = httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404


def test_runtime_routes_without_lora_enabled_are_400(tiny_model_dir):
    running = start_server(tiny_model_dir, allow_runtime_lora_updating=True)
    try:
        for route, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                            ("unload_lora_adapter", {"lora_name": "x"})):
            r = httpx.post(f"{running.url}/v1/{route}", json=body)
            assert r.status_code == 400 and "enable-lora" in r.json()["error"]["message"]
    finally:
        running.stop()
