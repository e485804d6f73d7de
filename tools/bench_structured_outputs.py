"""Structured outputs' cost on the default model: 32 prompts x 64 output tokens, greedy,
plain beside a regex that cannot complete within 64 tokens (same token counts, so the
difference is the per-step mask) and beside a JSON schema (whose outputs end early: the
model closes the object, so its tok/s also reflects a shrinking batch). Three rounds,
alternating.

    python tools/bench_structured_outputs.py
"""
import time, statistics, torch
from tessera import LLM, SamplingParams
torch.set_num_threads(2)
llm = LLM(None, show_progress=False, max_num_seqs=32)
prompts = [f"Write a short story number {i} about a fox and a dog." for i in range(32)]
plain = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
regex = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, structured_outputs={"regex": "[a-z ,.]{400}"})
schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
js = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, structured_outputs={"json": schema})
llm.generate(prompts[:4], regex, use_tqdm=False)
res = {"plain": [], "regex": [], "json": []}
for r in range(3):
    for name, p in (("plain", plain), ("regex", regex), ("json", js)):
        llm.reset_prefix_cache()
        t = time.perf_counter(); outs = llm.generate(prompts, p, use_tqdm=False); dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[name].append(n / dt)
for k, v in res.items(): print(k, ["%.1f" % x for x in v], "median %.1f" % statistics.median(v))
