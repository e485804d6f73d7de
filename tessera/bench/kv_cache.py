"""`tessera bench kv-cache`: an 8-bit KV cache beside the model-dtype one, in one run.

The cache's dtype is fixed when an engine is built, so the run builds one engine per cache
(the model dtype first) with the same settings and measures each the same way:
- capacity: bytes per cached token, and the tokens the sized cache holds;
- speed: per --batch-sizes, greedy requests of --input-len random tokens; prefill tokens/s
  until every request has its first token, then decode tokens/s for the rest (decode
  attention reads the whole context per step, so long inputs show what halving its bytes
  gives);
- accuracy: teacher-forced negative log-likelihood of text the package always has (its own
  source files) and how far each token's logprob moves from the model-dtype cache's.
"""
from __future__ import annotations

import ctypes
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tessera.bench.workload import Workload, median
from tessera.engine.engine import Engine
from tessera.llm import LLM
from tessera.runner.warmup import useful_blocks
from tessera.sampling.params import SamplingParams

# tessera's own source: natural-enough text that ships with every install
TEXT_FILES = ("engine/scheduler.py", "engine/block_manager.py", "runner/model_runner.py", "sampling/sampler.py")
TEXT_TOKENS = 1024  # per file


@dataclass
class KVSpeedResult:
    engine: str                 # "tessera, kv auto" / "tessera, kv fp8"
    batch_size: int
    decode_tokens_per_s: float  # tokens made after every request had its first, over that time
    prefill_tokens_per_s: float


@dataclass
class KVCacheSummary:
    engine: str
    kv_dtype: str
    kv_bytes_per_token: int
    cache_tokens: int           # what the sized cache holds
    cache_capped: bool          # sized to max_num_seqs x max_model_len, not by memory
    nll: float                  # mean over the text's tokens, nats
    mean_abs_logprob_change: float  # against the first (model-dtype) cache, per token


def text_prompts(engine: Engine) -> list[list[int]]:
    root = Path(__file__).resolve().parents[1]
    limit = min(TEXT_TOKENS, engine.max_model_len - 1)
    return [engine.encode((root / name).read_text())[:limit] for name in TEXT_FILES]


def teacher_forced_logprobs(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Each prompt token's logprob given the tokens before it, all prompts in order."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
    ids = [f"kv-text-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    outputs = {o.request_id: o for o in engine.iter_outputs(ids, stream=False)}
    return [lp[t].logprob for i, p in zip(ids, prompts)
            for t, lp in zip(p[1:], outputs[i].prompt_logprobs[1:])]


def timed_batch(engine: Engine, prefix: str, prompts: list[list[int]], output_len: int) -> tuple[float, float, int]:
    """(seconds until every request has its first token, seconds after that to the end,
    tokens made in that second stretch). Prompts longer than a step's budget prefill over
    several steps, and requests already prefilled decode meanwhile: those tokens belong to
    the first stretch."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", prompt, params)
    waiting = {f"{prefix}-{i}" for i in range(len(prompts))}
    first, made = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            waiting.discard(out.request_id)
            made += len(out.outputs[0].delta_token_ids) if first is None else 0
        if first is None and not waiting:
            first = time.perf_counter()
    return first - started, time.perf_counter() - first, len(prompts) * output_len - made


def kv_cache_bench(make_llm: Callable[[str], LLM], kv_dtypes: list[str], batch_sizes: list[int],
                   input_len: int, output_len: int, repeats: int) -> tuple[list[KVSpeedResult], list[KVCacheSummary]]:
    """`make_llm(kv_dtype)` builds the engine for one cache; the first of `kv_dtypes` is the
    baseline the logprob changes are measured against. One engine at a time: each is gone
    (weights and cache) before the next sizes its cache from the memory left."""
    speed, summary, reference = [], [], None
    for kv in kv_dtypes:
        row, rows, logprobs = _measure(make_llm(kv), f"tessera, kv {kv}", batch_sizes, input_len,
                                       output_len, repeats)
        _return_freed_memory()
        reference = reference or logprobs
        if len(logprobs) != len(reference):
            raise RuntimeError(f"kv {kv} scored {len(logprobs)} text tokens, the baseline {len(reference)}")
        row.mean_abs_logprob_change = sum(abs(a - b) for a, b in zip(logprobs, reference)) / len(logprobs)
        summary.append(row)
        speed.extend(rows)
    return speed, summary


def _return_freed_memory() -> None:
    """What the engine just measured held, back to the device and the OS: glibc keeps freed
    heap (the large prefill activations) in its arenas unless asked to trim them, and warm-up
    sizes the next cache from the memory the OS reports available."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _measure(llm: LLM, label: str, batch_sizes: list[int], input_len: int, output_len: int,
             repeats: int) -> tuple[KVCacheSummary, list[KVSpeedResult], list[float]]:
    with llm:
        engine = llm.engine
        logprobs = teacher_forced_logprobs(engine, text_prompts(engine))
        cache = engine.config.cache
        useful = useful_blocks(engine.config.scheduler.max_num_seqs, engine.max_model_len, cache.block_size)
        row = KVCacheSummary(label, str(engine.runner.kv_cache_dtype).removeprefix("torch."),
                             engine.runner.kv_bytes_per_block() // cache.block_size,
                             engine.num_blocks * cache.block_size,
                             cache.num_blocks is None and engine.num_blocks >= useful,
                             -sum(logprobs) / len(logprobs), 0.0)
        rows = []
        for size in batch_sizes:
            prompts = Workload(size, input_len, output_len).prompts(engine.router.config.vocab_size,
                                                                    engine.router.eos_token_ids)
            runs = [timed_batch(engine, f"kv-{size}-{r}", prompts, output_len) for r in range(repeats + 1)][1:]
            prefill = median([r[0] for r in runs])
            decode = median([r[2] / r[1] for r in runs])
            rows.append(KVSpeedResult(label, size, decode, size * input_len / prefill))
        engine.runner.release_kv_cache()  # the caller's next engine sizes its cache from what is left
    return row, rows, logprobs
