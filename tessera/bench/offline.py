"""Offline throughput and latency of the tessera engine (the `tessera bench` workloads)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from tessera.bench.workload import Workload, median
from tessera.llm import LLM
from tessera.sampling.params import SamplingParams


@dataclass
class ThroughputResult:
    engine: str
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def of(cls, engine: str, elapsed_s: float, prompts: list[list[int]], output_lens: list[int]
           ) -> ThroughputResult:
        """Rates of one run of `prompts`, each producing its `output_lens` tokens, in elapsed_s."""
        n_in, n_out = sum(map(len, prompts)), sum(output_lens)
        return cls(engine, elapsed_s, len(prompts) / elapsed_s, n_out / elapsed_s, (n_in + n_out) / elapsed_s,
                   len(prompts), n_in, n_out)


@dataclass
class LatencyResult:
    engine: str
    batch_size: int
    ttft_ms: float   # prompt processing until the first token of every row
    tpot_ms: float   # each further token of the batch
    roofline_ms: float | None = None   # the memory-bandwidth floor of a decode step (roofline.py)
    roofline_pct: float | None = None  # roofline_ms / tpot_ms, in percent


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)


def tessera_throughput(llm: LLM, prompts: list[list[int]], output_lens: list[int],
                       repeats: int) -> ThroughputResult:
    """All prompts at once, prompt i producing exactly output_lens[i] tokens (EOS ignored)."""
    llm.generate(prompts[:1], _params(4), use_tqdm=False)  # warm caches and allocator
    params = [_params(n) for n in output_lens]
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()  # each repeat prefills its prompts again, as the baseline does
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert [len(o.outputs[0].token_ids) for o in outs] == output_lens
    return ThroughputResult.of("tessera", median(times), prompts, output_lens)


def tessera_latency(llm: LLM, work: Workload, prompts: list[list[int]], repeats: int) -> LatencyResult:
    """TTFT: from submission until every row has its first token; TPOT: the remaining
    (output_len - 1) steps' average."""
    engine = llm.engine
    batch = prompts[:work.num_prompts]
    llm.generate(batch[:1], _params(4), use_tqdm=False)
    ttfts, tpots = [], []
    for r in range(repeats):
        ids = [f"bench-{r}-{i}" for i in range(len(batch))]
        llm.reset_prefix_cache()  # TTFT is a full prefill, not a cache hit on the last repeat
        start = time.perf_counter()
        for request_id, p in zip(ids, batch):
            engine.add_request(request_id, p, _params(work.output_len))
        first_seen: set[str] = set()
        first_done = None
        while engine.has_unfinished():
            for out in engine.step():
                first_seen.add(out.request_id)
            if first_done is None and len(first_seen) == len(ids):
                first_done = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first_done - start)
        tpots.append((end - first_done) / max(work.output_len - 1, 1))
    return LatencyResult("tessera", len(batch), median(ttfts) * 1e3, median(tpots) * 1e3)
