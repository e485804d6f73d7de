"""Embeddings of prompts with images (a multimodal model under --runner pooling, as
Qwen3-VL-Embedding and GME run): the language model's last normed hidden state, pooled,
equal to transformers' on the same ids and images; text prompts beside them; and over HTTP,
vLLM's chat-style /v1/embeddings `messages` with an image part."""
from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
import torch.nn.functional as F

from tessera import LLM, PoolingParams
from tessera.engine.request_checks import RequestError
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (QWEN_IMAGE, _qwen_inputs, image_prompt, make_tiny_qwen2_vl,
                                          make_tiny_qwen3_vl, random_image)

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = f"A {QWEN_IMAGE} picture of a fox"


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen-vl-embed")
    return folder, make_tiny_qwen2_vl(folder, TINY_CORPUS)


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    """(Qwen3-VL-Embedding's architecture: DeepStack features added after early layers)"""
    folder = tmp_path_factory.mktemp("qwen3-vl-embed")
    return folder, make_tiny_qwen3_vl(folder, TINY_CORPUS)


def hf_vector(hf, folder, text: str, images: list, pooling: str = "LAST") -> torch.Tensor:
    """transformers' normed last hidden states of the prompt, pooled and normalized."""
    prompt, kwargs = _qwen_inputs(folder, text, images, True)
    input_ids = torch.tensor([prompt])
    kwargs["mm_token_type_ids"] = (input_ids == kwargs.pop("pad")).int()
    with torch.no_grad():
        hidden = hf.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs).last_hidden_state[0]
    return F.normalize(hidden[-1] if pooling == "LAST" else hidden.mean(0), dim=-1)


@pytest.mark.parametrize("model, pooling", [("tiny_qwen_vl", "LAST"), ("tiny_qwen_vl", "MEAN"),
                                            ("tiny_qwen3_vl", "LAST")])
def test_image_prompts_embed_as_transformers(request, model, pooling):
    folder, hf = request.getfixturevalue(model)
    images = [random_image(1, size=(70, 100))]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, runner="pooling",
             pooler_config={"pooling_type": pooling}) as llm:
        assert llm.engine.is_pooling and llm.engine.supports_images
        outs = llm.embed([image_prompt(TEXT, images), "Paged attention stores", image_prompt(TEXT, images)])
        want = hf_vector(hf, folder, TEXT, images, pooling)
        torch.testing.assert_close(outs[0].outputs.data, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(outs[2].outputs.data, want, atol=1e-4, rtol=0)  # (a prefix hit for LAST)
        torch.testing.assert_close(outs[1].outputs.data, hf_vector(hf, folder, "Paged attention stores", [], pooling),
                                   atol=1e-4, rtol=0)
        other = llm.embed([image_prompt(TEXT, [random_image(2, size=(70, 100))])])[0].outputs.data
        assert (other - want).abs().max() > 1e-3  # the image matters
        with pytest.raises(RequestError, match="truncate_prompt_tokens cannot cut a prompt with images"):
            llm.embed([image_prompt(TEXT, images)], PoolingParams(truncate_prompt_tokens=4))


def test_chat_embeddings_with_an_image_over_http(tiny_qwen_vl):
    from tests.server.conftest import start_server

    folder, hf = tiny_qwen_vl
    image = random_image(3, size=(60, 60))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    running = start_server(folder, llm_kwargs={"runner": "pooling"})
    try:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "a fox"}]}]
        reply = httpx.post(running.url + "/v1/embeddings", timeout=60, json={"messages": messages}).json()
        vector = torch.tensor(reply["data"][0]["embedding"])
        # the template renders an image part as its placeholder (as the server hands it the part);
        # no generation prompt (vLLM's default for embeddings)
        text = running.state.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a fox"}]}],
            tokenize=False, add_generation_prompt=False)
        assert reply["usage"]["prompt_tokens"] == len(_qwen_inputs(folder, text, [image], True)[0])
        torch.testing.assert_close(vector, hf_vector(hf, folder, text, [image]), atol=1e-4, rtol=0)
    finally:
        running.stop()


def test_two_ranks_embed_as_one(tiny_qwen_vl):
    """Under tensor parallelism the driver encodes the image, every rank its share of the
    language model: transformers' vector."""
    folder, hf = tiny_qwen_vl
    images = [random_image(4, size=(70, 100))]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, runner="pooling",
             tensor_parallel_size=2) as llm:
        out = llm.embed([image_prompt(TEXT, images)])[0]
    torch.testing.assert_close(out.outputs.data, hf_vector(hf, folder, TEXT, images), atol=1e-4, rtol=0)
