"""The same workloads through transformers' `generate` (static batch, same dtype and threads),
run in the same process so the comparison shares the machine's state."""
from __future__ import annotations

import time

import torch

from tessera.bench.offline import LatencyResult, ThroughputResult
from tessera.bench.workload import Workload, median
from tessera.weights.source import ModelSource


def load_transformers_model(source: ModelSource, dtype: torch.dtype, dummy: bool = False,
                            device: torch.device | str = "cpu"):
    """The baseline model on `device` (the engine's); `dummy` (the engine runs
    --load-format dummy): transformers' own random initialisation of the same config, the
    same shapes and the same cost per token, initialised on the device itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source.path)), dtype=dtype)
    elif source.is_gguf:  # transformers dequantizes GGUF itself (needs `accelerate`)
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return model.to(device).eval()


class _FirstTokenClock:
    """A generate streamer that notes when the first generated tokens reach the host
    (generate hands it the prompt first, then each step's tokens, copied to the CPU)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _generate(model, prompts: list[list[int]], new_tokens: int, streamer: _FirstTokenClock | None = None) -> None:
    """One static batch; prompts of unequal length are left-padded (masked out)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=streamer)
    if out.is_cuda:  # the timer stops when the last token exists, not when it was queued
        torch.cuda.synchronize(out.device)
    assert out.shape[1] == ids.shape[1] + new_tokens


def transformers_throughput(model, prompts: list[list[int]], output_lens: list[int],
                            repeats: int) -> ThroughputResult:
    """The prompts as static batches, one per distinct output length (generate has one
    max_new_tokens per call), timed together."""
    groups: dict[int, list[list[int]]] = {}
    for prompt, n in zip(prompts, output_lens):
        groups.setdefault(n, []).append(prompt)
    _generate(model, prompts[:1], 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for n, batch in groups.items():
            _generate(model, batch, n)
        times.append(time.perf_counter() - start)
    return ThroughputResult.of("transformers", median(times), prompts, output_lens)


def transformers_latency(model, work: Workload, prompts: list[list[int]], repeats: int) -> LatencyResult:
    batch = prompts[:work.num_prompts]
    _generate(model, batch[:1], 4)
    # both from one run, as tessera's: separate 1-token and full runs made TPOT a difference
    # of two noisy timings, below zero on a busy host
    ttfts, tpots = [], []
    for _ in range(repeats):
        clock = _FirstTokenClock()
        start = time.perf_counter()
        _generate(model, batch, work.output_len, clock)
        end = time.perf_counter()
        ttfts.append(clock.first - start)
        tpots.append((end - clock.first) / max(work.output_len - 1, 1))
    return LatencyResult("transformers", len(batch), median(ttfts) * 1e3, median(tpots) * 1e3)
