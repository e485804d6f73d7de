"""Authentication, health before and after the engine, and `tessera serve` as a process:
ready on /health once loaded, draining a stream on SIGTERM, exit status 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import CHAT, HOST, MODEL_NAME, PROMPT, free_port, start_server, wait_until

KEY = "sekret-key"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    running = start_server(tiny_model_dir, api_key=KEY)
    yield running
    running.stop()


def test_api_key(keyed):
    url = keyed.url
    gen = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    assert httpx.get(url + "/health").status_code == 200  # open: load balancers probe it

    r = httpx.post(url + "/generate", json=gen)
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    r = httpx.post(url + "/generate", json=gen, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(url + "/generate", json=gen, headers={"authorization": KEY})  # no "Bearer "
    assert r.status_code == 401
    r = httpx.post(url + "/generate", json=gen, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "generated_text" in r.json()

    for path in ("/info", "/v1/models"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200, path
    err = httpx.get(url + "/v1/models").json()["error"]
    assert err["code"] == 401 and set(err) == {"message", "type", "param", "code"}

    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as good:
        out = good.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
        assert out.choices[0].message.role == "assistant"
    keyed.assert_idle()


def test_health_is_503_before_attach():
    loading = start_server(None, attach=False)
    try:
        r = httpx.get(loading.url + "/health")
        assert r.status_code == 503
        assert r.json() == {"error": "unhealthy", "error_type": "healthcheck"}
        r = httpx.post(loading.url + "/generate", json={"inputs": PROMPT})
        assert r.status_code == 503 and set(r.json()) == {"error", "error_type"}
        r = httpx.post(loading.url + "/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert httpx.get(loading.url + "/metrics").status_code == 200
    finally:
        loading.stop()


def test_health_is_503_once_the_engine_is_gone(tiny_model_dir):
    running = start_server(tiny_model_dir)
    try:
        assert httpx.get(running.url + "/health").status_code == 200
        running.engine.shutdown(timeout=1)
        assert wait_until(lambda: httpx.get(running.url + "/health").status_code == 503, timeout=5)
        r = httpx.post(running.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 503 and set(r.json()) == {"error", "error_type"}
    finally:
        running.stop()


class ServeRun:
    """What happened to one `tessera serve` process, for the tests below to check."""
    health: list[int]          # /health answers while it came up
    ready_after: float         # seconds from spawn to /health 200
    info: dict
    events: list[dict]         # the stream in flight at SIGTERM
    events_at_sigterm: int
    stream_error: BaseException | None
    returncode: int | None
    exit_after: float          # seconds from SIGTERM to exit
    log: str


@pytest.fixture(scope="module")
def serve_run(long_model_dir, tmp_path_factory) -> ServeRun:
    """`tessera serve` as a subprocess: wait for /health 200, start a long stream, SIGTERM
    once it has sent a token, then wait for the stream and the process to end."""
    run = ServeRun()
    port = free_port()
    url = f"http://{HOST}:{port}"
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    # One intra-op thread: with as many OpenMP threads as cores, another busy process on the
    # machine can slow each decode step ~40x (OpenMP barriers wait on a descheduled thread),
    # and this test is about shutdown, not about that.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("TESSERA_API_KEY", None)
    spawned = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "serve", "--model", str(long_model_dir), "--host", HOST,
             "--port", str(port), "--dtype", "float32", "--num-kv-blocks", "512",
             "--served-model-name", MODEL_NAME],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        run.health = []

        def ready() -> bool:
            if proc.poll() is not None:
                return True
            try:
                run.health.append(httpx.get(url + "/health", timeout=1).status_code)
            except httpx.TransportError:
                return False
            return run.health[-1] == 200

        wait_until(ready, timeout=60, interval=0.05)
        run.ready_after = time.monotonic() - spawned
        if not run.health or run.health[-1] != 200:
            pytest.fail(f"tessera serve never became healthy:\n{log_path.read_text()[-4000:]}")
        run.info = httpx.get(url + "/info").json()

        run.events, run.stream_error = [], None
        first = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", url + "/generate_stream", timeout=60, json={
                        "inputs": "Paged attention", "parameters": {"max_new_tokens": 600, "details": True}}) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            run.events.append(json.loads(line[5:]))
                            first.set()
            except BaseException as exc:  # noqa: BLE001 - checked by the tests
                run.stream_error = exc
            finally:
                first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        first.wait(30)
        proc.send_signal(signal.SIGTERM)
        run.events_at_sigterm = len(run.events)
        sent = time.monotonic()
        try:
            run.returncode = proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            run.returncode = None
        run.exit_after = time.monotonic() - sent
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    run.log = log_path.read_text()
    return run


def test_serve_is_healthy_once_loaded(serve_run):
    assert set(serve_run.health) <= {200, 503}, serve_run.health
    assert serve_run.health[-1] == 200
    assert serve_run.info["model_id"] == MODEL_NAME and serve_run.info["max_total_tokens"] == 4096


def test_serve_drains_the_stream_on_sigterm(serve_run):
    assert serve_run.stream_error is None, repr(serve_run.stream_error)
    events = serve_run.events
    # the stream ended as a stream ends: its last event carries the text and the details
    # (whether it ran to the end or the server ended it cleanly)
    assert events and "error" not in events[-1], events[-1:]
    assert events[-1]["generated_text"] is not None, f"stream cut off after {len(events)} events"
    assert events[-1]["details"]["generated_tokens"] == len(events) == 600
    assert serve_run.events_at_sigterm < len(events)  # it was in flight


def test_serve_exits_promptly_on_sigterm(serve_run):
    assert serve_run.returncode is not None, "still running 45s after SIGTERM:\n" + serve_run.log[-3000:]
    assert serve_run.exit_after < 30


def test_serve_exit_status_is_0_after_sigterm(serve_run):
    assert serve_run.returncode == 0, f"exit status {serve_run.returncode}:\n{serve_run.log[-2000:]}"


SLOW_LOAD = """
import logging, sys
import torch
from tessera.server.serve import run_server

def make_engine():  # a load that never ends, busy in torch as a real one is
    a = torch.randn(256, 256)
    while True:
        a = torch.tanh(a @ a)

logging.basicConfig(level=logging.INFO)
sys.exit(run_server(make_engine, model_name="slow", host=sys.argv[1], port=int(sys.argv[2])))
"""


def test_sigterm_while_the_model_loads_exits_cleanly(tmp_path):
    """A server stopped before its model is ready (a rollout replacing a pod that is still
    warming up) exits with status 0 and says why. Before, the interpreter's exit tore torch
    down under the busy loader thread: std::terminate, an abort with status 134."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, HOST, str(port)], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def answering() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 503
            except httpx.TransportError:
                return proc.poll() is not None

        wait_until(answering, timeout=60, interval=0.05)
        time.sleep(0.5)  # the loader is in its torch loop
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    log = log_path.read_text()
    assert returncode == 0, f"exit status {returncode}:\n{log[-2000:]}"
    assert "stopped while the model was loading" in log and "terminate called" not in log, log[-2000:]
