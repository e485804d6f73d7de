"""Images over HTTP, driven by real clients: OpenAI image_url parts (data URLs, http URLs,
allowed local files) and TGI's markdown images, against transformers' answers."""
from __future__ import annotations

import functools
import http.server
import json
import threading

import httpx
import openai
import pytest
import torch
from transformers import AutoProcessor

from tests.multimodal.checkpoints import data_url, png_bytes, random_image
from tests.server.conftest import start_server

N = 12


@pytest.fixture(scope="module")
def vlm_server(tiny_llava):
    folder, _ = tiny_llava
    running = start_server(folder)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(vlm_server):
    return openai.OpenAI(base_url=f"{vlm_server.url}/v1", api_key="-")


def hf_text(tiny_llava, text: str, images: list, add_special_tokens: bool) -> str:
    """transformers' greedy continuation of a rendered prompt with images, as text."""
    folder, hf = tiny_llava
    processor = AutoProcessor.from_pretrained(str(folder))
    inputs = processor(images=images, text=text, return_tensors="pt", add_special_tokens=add_special_tokens)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat(client, url: str, **kw):
    return client.chat.completions.create(
        model="tiny", max_tokens=N, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is "},
                                               {"type": "image_url", "image_url": {"url": url}}]}], **kw)


RENDERED = "user: What is <image>\nassistant:"


def test_chat_with_a_data_url_image(tiny_llava, vlm_server, client):
    image = random_image(21)
    reply = chat(client, data_url(image))
    assert reply.choices[0].message.content == hf_text(tiny_llava, RENDERED, [image], add_special_tokens=False)
    processor = AutoProcessor.from_pretrained(str(tiny_llava[0]))
    expanded = processor(images=[image], text=RENDERED, add_special_tokens=False)["input_ids"][0]
    assert reply.usage.prompt_tokens == len(expanded) == len(processor.tokenizer(RENDERED).input_ids) - 1 + 15
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, data_url(image), stream=True)
                       if c.choices)
    assert streamed == reply.choices[0].message.content
    vlm_server.assert_idle()


def test_responses_api_with_an_input_image(tiny_llava, vlm_server, client):
    """/v1/responses: an input_image part is the chat request's image_url part."""
    image = random_image(23)
    resp = client.responses.create(model="tiny", max_output_tokens=N, temperature=0.0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                     {"type": "input_image", "image_url": data_url(image)}]}])
    assert resp.output_text == hf_text(tiny_llava, RENDERED, [image], add_special_tokens=False)
    assert resp.usage.input_tokens == chat(client, data_url(image)).usage.prompt_tokens
    vlm_server.assert_idle()


def test_an_http_image_url_is_fetched(tiny_llava, vlm_server, client, tmp_path):
    image = random_image(22)
    (tmp_path / "cat.png").write_bytes(png_bytes(image))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as files:
        threading.Thread(target=files.serve_forever, daemon=True).start()
        try:
            base = f"http://127.0.0.1:{files.server_address[1]}"
            reply = chat(client, f"{base}/cat.png")
            with pytest.raises(openai.BadRequestError, match="HTTP 404"):
                chat(client, f"{base}/missing.png")
        finally:
            files.shutdown()
    assert reply.choices[0].message.content == chat(client, data_url(image)).choices[0].message.content


def test_local_files_only_under_the_allowed_path(vlm_server, client, tmp_path):
    image = random_image(23)
    inside = tmp_path / "allowed"
    inside.mkdir()
    (inside / "a.png").write_bytes(png_bytes(image))
    (tmp_path / "b.png").write_bytes(png_bytes(image))
    with pytest.raises(openai.BadRequestError, match="allowed-local-media-path"):
        chat(client, f"file://{inside / 'a.png'}")
    vlm_server.state.allowed_local_media_path = inside
    try:
        reply = chat(client, f"file://{inside / 'a.png'}")
        with pytest.raises(openai.BadRequestError, match="outside the allowed"):
            chat(client, str(tmp_path / "b.png"))
    finally:
        vlm_server.state.allowed_local_media_path = None
    assert reply.choices[0].message.content == chat(client, data_url(image)).choices[0].message.content


def test_bad_images_are_400s_with_the_openai_error_shape(vlm_server):
    for url, message in [("data:image/png;base64,@@@", "not valid base64"),
                         ("data:image/png;base64," + "aGVsbG8=", "not an image"),
                         ("ftp://example/x.png", "image URLs are http(s)://, data: or file:// URLs"),
                         ("http://[::1/x.png", "failed")]:
        r = httpx.post(f"{vlm_server.url}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == "messages"
    r = httpx.post(f"{vlm_server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}]})
    assert r.status_code == 400 and "unsupported content part type 'audio_url'" in r.json()["error"]["message"]
    vlm_server.assert_idle()


def test_info_names_the_image_pipeline(vlm_server):
    assert httpx.get(f"{vlm_server.url}/info").json()["model_pipeline_tag"] == "image-text-to-text"  # TGI's, for VLMs


def test_tgi_markdown_images(tiny_llava, vlm_server):
    image = random_image(24)
    want = hf_text(tiny_llava, "The quick <image> brown", [image], add_special_tokens=True)
    body = {"inputs": f"The quick ![]({data_url(image)}) brown",
            "parameters": {"max_new_tokens": N, "details": True, "decoder_input_details": True}}
    r = httpx.post(f"{vlm_server.url}/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == want
    processor = AutoProcessor.from_pretrained(str(tiny_llava[0]))
    prefill = r.json()["details"]["prefill"]
    assert [t["id"] for t in prefill] == processor(images=[image], text="The quick <image> brown")["input_ids"][0]
    assert sum(t["text"] == "<image>" for t in prefill) == 16
    with httpx.stream("POST", f"{vlm_server.url}/generate_stream", json={**body, "parameters": {"max_new_tokens": N}},
                      timeout=30) as s:
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    assert json.loads(events[-1][len("data:"):])["generated_text"] == want
    r = httpx.post(f"{vlm_server.url}/generate", json={"inputs": "Look ![](data:image/png;base64,AAAA)",
                                                       "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    vlm_server.assert_idle()


def test_a_text_model_server_refuses_image_parts(make_tiny_llama):
    folder, _ = make_tiny_llama()
    running = start_server(folder)
    try:
        r = httpx.post(f"{running.url}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}]}]})
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
        assert running.state.limits.max_body_bytes == 2_000_000  # TGI's limit; 50 MB for image models
    finally:
        running.stop()


def test_concurrent_image_requests(vlm_server, client):
    """Eight clients at once, each its own image (processed on worker threads, batched by
    the engine): every answer is the one that image gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    urls = [data_url(random_image(30 + i, size=(40 + 3 * i, 50))) for i in range(8)]
    alone = [chat(client, url).choices[0].message.content for url in urls]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda url: chat(client, url).choices[0].message.content, urls))
    assert together == alone
    assert len(set(alone)) > 1
    vlm_server.assert_idle()


def test_limits_come_before_any_image_is_read(vlm_server, monkeypatch):
    """More images than --limit-mm-per-prompt is a 400 naming the flag (the URLs are never
    fetched: nothing listens there); an image of too many pixels is refused from its header
    (a small file can decode to gigabytes)."""
    import tessera.multimodal.images as images

    monkeypatch.setattr(vlm_server.state.limits, "max_images_per_prompt", 1)
    parts = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never.png"}}] * 2
    r = httpx.post(f"{vlm_server.url}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and "--limit-mm-per-prompt" in r.json()["error"]["message"]
    r = httpx.post(f"{vlm_server.url}/generate", json={"inputs": "![](http://127.0.0.1:9/a.png)![](http://127.0.0.1:9/b.png)",
                                                       "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 422 and "at most 1 images" in r.json()["error"]
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 50 * 40 - 1)
    r = httpx.post(f"{vlm_server.url}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(random_image(1, size=(50, 40)))}}]}]})
    assert r.status_code == 400 and "50 x 40 pixels" in r.json()["error"]["message"]
    vlm_server.assert_idle()


def test_a_processor_refusal_is_a_400(tmp_path):
    """Qwen's image processor refuses an aspect ratio over 200: the client hears why."""
    from tests.conftest import TINY_CORPUS
    from tests.multimodal.checkpoints import make_tiny_qwen2_vl

    make_tiny_qwen2_vl(tmp_path, TINY_CORPUS)
    running = start_server(tmp_path)
    try:
        r = httpx.post(f"{running.url}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(random_image(1, size=(2000, 5)))}}]}]})
        assert r.status_code == 400, r.text
        assert "cannot take these images" in r.json()["error"]["message"]
        running.assert_idle()
    finally:
        running.stop()


def test_a_chunked_body_over_the_payload_limit_is_a_413(vlm_server, monkeypatch):
    """A body sent without content-length (chunked) is counted as it arrives."""
    monkeypatch.setattr(vlm_server.state.limits, "max_body_bytes", 100_000)
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(random_image(1, size=(300, 300)))}}]}]}).encode()
    assert len(body) > 100_000
    chunks = (body[i:i + 4096] for i in range(0, len(body), 4096))
    r = httpx.post(f"{vlm_server.url}/v1/chat/completions", content=chunks,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--payload-limit" in r.json()["error"]["message"]
    small = json.dumps({"inputs": "The quick", "parameters": {"max_new_tokens": 2}}).encode()
    r = httpx.post(f"{vlm_server.url}/generate", content=iter([small[:5], small[5:]]),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    vlm_server.assert_idle()


def test_a_download_has_a_deadline_for_everything_headers_included(vlm_server, client, monkeypatch):
    """A server that sends its headers a byte at a time is cut off at the deadline, and
    meanwhile a data-URL request is answered (downloads hold no worker thread)."""
    import socket
    import time

    import tessera.multimodal.images as images

    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 1.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.2):
                try:
                    conn.sendall(b"X")
                except OSError:
                    return

    threading.Thread(target=drip, daemon=True).start()
    try:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError, match="took longer than"):
            chat(client, f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png")
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        listener.close()
    vlm_server.assert_idle()
