"""`tessera bench serve` against a real server (tiny random llama on loopback), all three
backends; a dead URL; the Poisson schedule."""
from __future__ import annotations

import asyncio
import json

import pytest

from tessera.bench.serve import concurrency_levels, dataset_prompts, random_prompts
from tessera.bench.serve_client import poisson_schedule, request_body, run_level, served_model
from tessera.cli import main
from tests.server.conftest import HOST, MODEL_NAME, free_port, start_server

OUTPUT_LEN = 8
NUM = 6


@pytest.fixture(scope="module")
def server(make_tiny_llama, one_thread):
    folder, _ = make_tiny_llama()
    running = start_server(folder)
    yield running
    running.stop()


def _bench(url: str, backend: str, *extra: str) -> int:
    return main(["bench", "serve", "--url", url, "--backend", backend, "--num-prompts", str(NUM),
                 "--input-len", "12", "--output-len", str(OUTPUT_LEN), *extra])


@pytest.mark.parametrize("backend", ["tgi", "openai", "openai-chat"])
def test_every_request_is_timed_per_token(server, backend):
    model = served_model(server.url) if backend != "tgi" else None
    bodies = [request_body(backend, p, OUTPUT_LEN, model) for p in random_prompts(NUM, 12, seed=0)]
    run = asyncio.run(run_level(server.url, backend, bodies, 2, poisson_schedule(NUM, float("inf"), 0),
                                progress=False))
    assert [r.error for r in run.records] == [""] * NUM
    for r in run.records:
        assert r.ok and r.output_tokens == OUTPUT_LEN  # ignore_eos / no stop: the full length
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.prompt_tokens and r.prompt_tokens >= 12  # the server's own count
        assert len(r.itl_s) == r.chunks - 1
        if backend != "openai-chat":  # chat holds back tokens that end mid-character
            assert r.chunks == OUTPUT_LEN
    server.assert_idle()


@pytest.mark.parametrize("backend", ["tgi", "openai", "openai-chat"])
def test_cli_writes_json(server, tmp_path, capsys, backend):
    out = tmp_path / "serve.json"
    assert _bench(server.url, backend, "--concurrency", "2", "--output-json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["backend"] == backend
    assert data["meta"]["model"] == (None if backend == "tgi" else MODEL_NAME)
    (level,) = data["results"]
    assert (level["completed"], level["failed"], level["concurrency"]) == (NUM, 0, "2")
    assert level["output_tokens"] == NUM * OUTPUT_LEN and level["output_tokens_per_s"] > 0
    lat = level["latency_ms"]
    assert 0 < lat["ttft_p50_ms"] <= lat["e2e_p50_ms"] and lat["tpot_mean_ms"] > 0 and lat["itl_p99_ms"] > 0
    table = capsys.readouterr().out
    assert "| 2 | 6 | 0 |" in table and "| 2 | itl |" in table


def test_sweep_writes_one_level_each_and_a_png(server, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert _bench(server.url, "openai", "--concurrency", "1,3", "--output-json", str(out), "--plot", str(png)) == 0
    levels = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["completed"]) for r in levels] == [("1", NUM), ("3", NUM)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_listening_counts_failures(tmp_path, capsys):
    url = f"http://{HOST}:{free_port()}"
    bodies = [request_body("openai", "hello", 4, None)] * 3
    run = asyncio.run(run_level(url, "openai", bodies, 2, [0.0] * 3, progress=False))
    assert not any(r.ok for r in run.records)
    assert all(r.error.startswith("ConnectError") for r in run.records)
    out = tmp_path / "dead.json"
    assert _bench(url, "tgi", "--output-json", str(out)) == 1  # a result, not a crash
    (level,) = json.loads(out.read_text())["results"]
    assert (level["completed"], level["failed"]) == (0, NUM)
    assert level["errors"] and level["errors"][0].startswith("ConnectError")
    assert level["latency_ms"]["ttft_mean_ms"] is None
    assert "failed: ConnectError" in capsys.readouterr().out


def test_poisson_schedule_is_seeded():
    a, b = poisson_schedule(200, 4.0, seed=7), poisson_schedule(200, 4.0, seed=7)
    assert a == b and a != poisson_schedule(200, 4.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert 0.15 < a[-1] / 199 < 0.35  # mean gap near 1 / rate
    assert poisson_schedule(3, float("inf"), seed=7) == [0.0, 0.0, 0.0]


def test_prompts_and_levels(tmp_path):
    assert random_prompts(3, 5, seed=1) == random_prompts(3, 5, seed=1)
    assert all(len(p.split()) == 5 for p in random_prompts(3, 5, seed=1))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert dataset_prompts(data, 3) == ["a", "b", "a"]
    assert concurrency_levels("1,4,16") == [1, 4, 16] and concurrency_levels(None) == [None]
