"""The server on a CUDA GPU (skipped without one), as `tessera serve` runs there by default:
CUDA graphs, Triton kernels and async scheduling behind the TGI and OpenAI routes. Its
answers to concurrent clients, streamed and not, equal an offline synchronous engine's on
the same GPU (float32, greedy), and every KV block is free afterwards."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from text_generation import Client

from tessera import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, start_server

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:text_generation")]

PROMPTS = ["Paged attention", "The quick brown fox", "Continuous batching", "A KV cache"]


@pytest.fixture(scope="module")
def gpu_server(tiny_model_dir):
    running = start_server(tiny_model_dir, llm_kwargs={"device": "cuda"})
    config = running.engine.engine.config
    assert config.device == "cuda" and config.scheduler.async_scheduling
    yield running
    running.stop()


def test_gpu_server_answers_equal_a_synchronous_gpu_engine(gpu_server, tiny_model_dir):
    lengths = [6 + 9 * i for i in range(len(PROMPTS))]
    with LLM(tiny_model_dir, dtype="float32", device="cuda", num_kv_blocks=512, async_scheduling=False,
             show_progress=False) as llm:
        expected = [o.outputs[0] for o in llm.generate(
            PROMPTS, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in lengths])]
    client = Client(gpu_server.url, timeout=120)

    def generate(job: tuple[str, int]):
        return client.generate(job[0], max_new_tokens=job[1])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(generate, zip(PROMPTS, lengths)))
    assert [[t.id for t in a.details.tokens] for a in answers] == [list(e.token_ids) for e in expected]
    assert [a.generated_text for a in answers] == [e.text for e in expected]

    streamed = list(client.generate_stream(PROMPTS[0], max_new_tokens=lengths[0]))
    assert [r.token.id for r in streamed] == list(expected[0].token_ids)
    chunks = openai.OpenAI(base_url=gpu_server.url + "/v1", api_key="unused").completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=lengths[1], temperature=0, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == expected[1].text and usage.completion_tokens == len(expected[1].token_ids)
    gpu_server.assert_idle()
