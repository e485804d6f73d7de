"""`tessera serve` with two tensor-parallel ranks over real HTTP: the same tokens as one
rank, and a rank that dies turns /health to 503 and every request into an error within
seconds (no hang)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import PROMPT, start_server, wait_until

pytestmark = pytest.mark.usefixtures("one_thread")

BODY = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}


def test_tp2_serves_one_ranks_tokens_and_fails_loudly_when_a_rank_dies(tiny_model_dir):
    one = start_server(tiny_model_dir)
    try:
        want = httpx.post(f"{one.url}/generate", json=BODY, timeout=30).json()
    finally:
        one.stop()
    two = start_server(tiny_model_dir, llm_kwargs={"tensor_parallel_size": 2})
    try:
        r = httpx.post(f"{two.url}/generate", json=BODY, timeout=30)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["generated_text"] == want["generated_text"]
        assert [t["id"] for t in got["details"]["tokens"]] == [t["id"] for t in want["details"]["tokens"]]
        two.engine.engine.tp_group.processes[0].kill()
        started = time.monotonic()
        r = httpx.post(f"{two.url}/generate", json=BODY, timeout=30)
        assert r.status_code in (424, 503), r.text
        assert "rank 1" in r.json()["error"] or r.status_code == 503
        assert wait_until(lambda: httpx.get(f"{two.url}/health", timeout=5).status_code == 503, timeout=10)
        assert time.monotonic() - started < 15
        r = httpx.post(f"{two.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                          "max_tokens": 4}, timeout=30)
        assert r.status_code == 503, r.text
    finally:
        two.stop()


def test_a_rank_that_dies_during_a_stuck_step_fails_the_request_at_once(tiny_model_dir, monkeypatch):
    """The driver's step is held inside the model (as a collective that has not noticed its
    peer's death would hold it): the group's watcher still fails the request, the one queued
    behind the step, and /health."""
    two = start_server(tiny_model_dir, llm_kwargs={"tensor_parallel_size": 2})
    runner = two.engine.engine.runner
    entered, release = threading.Event(), threading.Event()
    execute = runner.execute

    def held_execute(*args, **kwargs):
        entered.set()
        release.wait(timeout=60)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", held_execute)
    try:
        with httpx.Client(timeout=30) as client:
            with ThreadPoolExecutor(2) as pool:
                pending = pool.submit(client.post, f"{two.url}/generate", json=BODY)
                assert entered.wait(timeout=10)
                queued = pool.submit(client.post, f"{two.url}/generate", json=BODY)  # waits behind the step
                assert wait_until(lambda: two.engine.num_in_flight == 2, timeout=10)
                two.engine.engine.tp_group.processes[0].kill()
                started = time.monotonic()
                r = pending.result(timeout=15)
                second = queued.result(timeout=15)
            assert time.monotonic() - started < 10
            assert r.status_code == 424, r.text
            assert "rank 1" in r.json()["error"]
            assert second.status_code == 503 and "rank 1" in second.json()["error"], second.text
            assert client.get(f"{two.url}/health").status_code == 503
            assert client.post(f"{two.url}/generate", json=BODY).status_code == 503
    finally:
        release.set()
        two.stop()
