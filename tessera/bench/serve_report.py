"""Metrics of a `tessera bench serve` level (throughputs; TTFT, TPOT, ITL and end-to-end latency
as mean / p50 / p90 / p99), its tables, and the sweep plot."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tessera.bench.report import plot_panels
from tessera.bench.serve_client import LevelRun, RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
MAX_ERRORS = 5  # the first few distinct messages are enough to diagnose a failing run


@dataclass
class LevelResult:
    concurrency: str              # "max" when uncapped
    request_rate: str             # "inf": all sent at once
    completed: int
    failed: int
    duration_s: float
    request_throughput: float     # completed requests / duration
    output_tokens_per_s: float
    total_tokens_per_s: float     # (prompt tokens the server reported + output) / duration
    prompt_tokens: int
    output_tokens: int
    # <metric>_<stat>_ms for each of LATENCIES x STATS; None when no request measured it
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


@dataclass
class LatencyRow:
    concurrency: str
    metric: str
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(STATS)
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def tpot_s(rec: RequestRecord) -> float | None:
    """Time per output token after the first; undefined for a one-token answer."""
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1) if rec.output_tokens > 1 else None


def summarize(run: LevelRun, concurrency: int | None, request_rate: float) -> LevelResult:
    done = [r for r in run.records if r.ok]
    failed = [r for r in run.records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    samples = {"ttft": [r.ttft_s for r in done], "e2e": [r.e2e_s for r in done],
               "tpot": [t for r in done if (t := tpot_s(r)) is not None],
               "itl": [gap for r in done for gap in r.itl_s]}
    latency = {f"{m}_{s}_ms": v for m in LATENCIES for s, v in _stats(samples[m]).items()}
    errors = list(dict.fromkeys(r.error for r in failed))[:MAX_ERRORS]
    d = run.duration_s
    return LevelResult(str(concurrency or "max"), str(request_rate), len(done), len(failed), d,
                       len(done) / d, out_tokens / d, (out_tokens + prompt_tokens) / d,
                       prompt_tokens, out_tokens, latency, errors)


def latency_rows(results: list[LevelResult]) -> list[LatencyRow]:
    return [LatencyRow(r.concurrency, m, *(r.latency_ms[f"{m}_{s}_ms"] for s in STATS))
            for r in results for m in LATENCIES]


SUMMARY_COLUMNS = ["concurrency", "completed", "failed", "request_throughput", "output_tokens_per_s",
                   "total_tokens_per_s", "duration_s"]
LATENCY_COLUMNS = ["concurrency", "metric", "mean_ms", "p50_ms", "p90_ms", "p99_ms"]


def plot_sweep(results: list[LevelResult], path: Path) -> None:
    """Output tok/s and p99 ITL against concurrency: where throughput stops paying for latency."""
    plot_panels(path, "concurrency", [str(r.concurrency) for r in results],
                [("Throughput", "output tokens/s", {"": [r.output_tokens_per_s for r in results]}),
                 ("p99 inter-token latency", "ms", {"": [r.latency_ms["itl_p99_ms"] or 0.0 for r in results]})])
