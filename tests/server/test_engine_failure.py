"""An engine step that raises fails the requests it was running with the documented error
bodies (TGI 424 `generation`, OpenAI 500), frees their blocks, and the server keeps
serving; a dead engine loop turns /health to 503 and fails waiting requests, not hangs."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import CHAT, PROMPT, start_server, wait_until


@pytest.fixture
def fragile(tiny_model_dir):
    running = start_server(tiny_model_dir)
    yield running
    running.stop()


def _fail_next_steps(running, count: int) -> None:
    runner = running.engine.engine.runner
    original = runner.execute
    left = {"n": count}

    def execute(*args, **kwargs):
        if left["n"] > 0:
            left["n"] -= 1
            raise RuntimeError("simulated kernel failure")
        return original(*args, **kwargs)

    runner.execute = execute


def test_step_failure_is_a_424_then_the_server_recovers(fragile):
    url = fragile.url
    _fail_next_steps(fragile, 1)
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}, timeout=30)
    assert r.status_code == 424
    assert r.json() == {"error": "Request failed during generation: simulated kernel failure",
                        "error_type": "generation"}
    _fail_next_steps(fragile, 1)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "simulated kernel failure" and r.json()["error"]["code"] == 500
    fragile.assert_idle()
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}, timeout=30)
    assert r.status_code == 200 and r.json()["generated_text"]


def test_step_failure_mid_stream_is_an_error_event(fragile):
    url = fragile.url
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 50}}
    events = []
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:])
                if len(events) == 2:
                    _fail_next_steps(fragile, 1)
    assert '"error_type": "generation"' in events[-1]
    assert len(events) < 50
    fragile.assert_idle()


def test_dead_engine_loop_means_unhealthy_and_errors(fragile):
    url = fragile.url
    core = fragile.engine.engine
    core.step = lambda: (_ for _ in ()).throw(SystemExit("loop killed"))  # not an Exception: kills the loop
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}, timeout=30)
    assert r.status_code == 503
    assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, timeout=5)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
