"""Beam search's cost on the default model: one request of 128 random prompt tokens and 64
new tokens a sequence, greedy vs n=4 sampled vs beam search of width 4, alternating, medians
of 5 (after one warm round); then the KV blocks the beams hold at their peak against four
unshared sequences, and the beams of a real prompt.

    python tools/bench_beam_search.py
"""
import statistics
import time

import torch

from tessera import LLM, SamplingParams

llm = LLM(show_progress=False)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 40000, (128,), generator=g).tolist()
cases = {"greedy": SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
         "n=4 sampled": SamplingParams(temperature=0.8, n=4, seed=0, max_tokens=64, ignore_eos=True),
         "beam width 4": SamplingParams(use_beam_search=True, n=4, max_tokens=64, ignore_eos=True)}
times = {k: [] for k in cases}
for r in range(6):
    for k, p in cases.items():
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate([prompt], p, use_tqdm=False)
        times[k].append(time.perf_counter() - t)
for k, v in times.items():
    print(f"{k}: {statistics.median(v[1:]) * 1e3:.0f} ms per request (64 tokens a sequence)")
m = llm.engine.block_manager
peak = [0]
step = llm.engine.step


def counting(*a, **kw):
    out = step(*a, **kw)
    peak[0] = max(peak[0], m.num_blocks - m.num_free_blocks)
    return out


llm.engine.step = counting
llm.reset_prefix_cache()
llm.generate([prompt], cases["beam width 4"], use_tqdm=False)
print("beam search peak KV blocks:", peak[0], "; 4 unshared sequences would hold", 4 * m.num_blocks_for(192))
beams = SamplingParams(use_beam_search=True, n=3, max_tokens=12)
out = llm.generate(["The capital of France is"], beams, use_tqdm=False)[0]
for c in out.outputs:
    print(repr(c.text), round(c.cumulative_logprob, 3), c.finish_reason)
