"""Captured decode graphs vs eager decode steps (CPU), interleaved in one process so that
host drift cancels: one LLM of each on the same model (e.g. a config.json-only folder with
--load-format dummy), alternating generate calls; the decode time per token is
(time of N tokens - time of 1 token) / (N - 1), the median over rounds.

    python tools/bench_decode_graphs.py FOLDER [--batch-sizes 1,8] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera import LLM, SamplingParams


def per_token_ms(llm: LLM, prompts: list[dict], new_tokens: int) -> float:
    timed = []
    for n in (1, new_tokens):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        timed.append(time.perf_counter() - started)
    return (timed[1] - timed[0]) / (new_tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load-format", default="dummy")
    args = parser.parse_args()
    llms = {mode: LLM(args.folder, load_format=args.load_format, dtype="bfloat16", enforce_eager=mode == "eager",
                      num_kv_blocks=512, show_progress=False) for mode in ("eager", "graphs")}
    g = torch.Generator().manual_seed(0)
    print("| batch | eager ms/token | graphs ms/token | graphs / eager | captured buckets |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [{"prompt_token_ids": torch.randint(1000, 30000, (args.prompt_len,), generator=g).tolist()}
                   for _ in range(batch)]
        for llm in llms.values():  # warm-up: the graphs capture here
            per_token_ms(llm, prompts, 4)
        times = {mode: [] for mode in llms}
        for _ in range(args.rounds):
            for mode, llm in llms.items():
                times[mode].append(per_token_ms(llm, prompts, args.new_tokens))
        eager, graphs = (statistics.median(times[m]) for m in ("eager", "graphs"))
        print(f"| {batch} | {eager:.1f} | {graphs:.1f} | {graphs / eager:.2f} | "
              f"{llms['graphs'].engine.runner.graphs.captured_sizes} |")


if __name__ == "__main__":
    main()
