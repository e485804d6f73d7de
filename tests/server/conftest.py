"""Real servers on loopback for the HTTP tests: the FastAPI app under uvicorn in a background
thread, in front of a real engine running a tiny random llama (float32, CPU)."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from tessera.llm import LLM
from tessera.server.app import create_app
from tessera.server.async_engine import AsyncEngine
from tessera.server.state import ServerLimits, ServerState

HOST = "127.0.0.1"
MODEL_NAME = "tiny"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paged attention stores the KV cache"}]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


@dataclass
class RunningServer:
    url: str
    state: ServerState
    engine: AsyncEngine | None
    server: uvicorn.Server
    thread: threading.Thread

    def idle(self) -> bool:
        """No request in flight anywhere, and every KV block free."""
        if self.engine is None:
            return True
        core = self.engine.engine
        return (self.engine.num_in_flight == 0 and not core.has_unfinished() and not core.requests
                and not self.engine._sinks and core.block_manager.all_free())

    def assert_idle(self, timeout: float = 5.0) -> None:
        # Aborts are applied by the engine thread, and a finished stream is released by the
        # server a moment after the client has read its end: poll briefly.
        if not wait_until(self.idle, timeout):
            core = self.engine.engine
            raise AssertionError(
                f"server not idle after {timeout}s: in_flight={self.engine.num_in_flight} "
                f"unfinished={core.has_unfinished()} requests={list(core.requests)} "
                f"free_blocks={core.block_manager.num_free_blocks}/{core.block_manager.num_blocks}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.engine is not None:
            self.engine.shutdown(timeout=5)


def start_server(folder: Path | None, *, max_concurrent_requests: int = 128, api_key: str | None = None,
                 attach: bool = True, llm_kwargs: dict | None = None,
                 allow_runtime_lora_updating: bool = False, **limits) -> RunningServer:
    """The app on a free loopback port; `attach=False` leaves the state unattached (loading)."""
    engine = None
    state = ServerState(model_name=MODEL_NAME,
                        limits=ServerLimits(max_concurrent_requests=max_concurrent_requests, **limits),
                        api_key=api_key, allow_runtime_lora_updating=allow_runtime_lora_updating)
    if attach:
        core = LLM(folder, dtype="float32", num_kv_blocks=512, show_progress=False, **(llm_kwargs or {})).engine
        engine = AsyncEngine(core, max_concurrent_requests=max_concurrent_requests)
        engine.start()
        state.attach(engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    running = RunningServer(f"http://{HOST}:{port}", state, engine, server, thread)

    def up() -> bool:
        if not server.started:
            return False
        try:
            code = httpx.get(f"{running.url}/health", timeout=1).status_code
        except httpx.TransportError:
            return False
        return code == 200 or not attach

    if not wait_until(up, timeout=30, interval=0.05):
        running.stop()
        raise RuntimeError("the test server did not come up within 30s")
    return running


@pytest.fixture(autouse=True)
def hub_client_on_loopback(monkeypatch):
    """huggingface_hub's clients refuse every request, even to a server on loopback, when
    HF_HUB_OFFLINE is set (as it may be on a machine without a hub); these tests only talk
    to their own server."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_llama) -> Path:
    folder, _ = make_tiny_llama()
    return folder


@pytest.fixture(scope="session")
def long_model_dir(make_tiny_llama) -> Path:
    """The same tiny llama with a 4096-token context: requests that run for seconds."""
    folder, _ = make_tiny_llama(max_position_embeddings=4096)
    return folder


@pytest.fixture(scope="session")
def shared_server(tiny_model_dir):
    running = start_server(tiny_model_dir, max_concurrent_requests=128)
    yield running
    running.stop()


@pytest.fixture
def server(shared_server):
    """The shared server, checked idle (no request, no KV block in use) after each test."""
    shared_server.assert_idle()
    yield shared_server
    shared_server.assert_idle()


@pytest.fixture
def url(server) -> str:
    return server.url


@pytest.fixture
def openai_client(url):
    """The openai package's client of the shared server (no retries: a failure shows at once)."""
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def client(openai_client):
    """The client a test file talks with; files of another SDK (Anthropic's) override it."""
    return openai_client
