"""What the watermark costs: output tokens per second of the same requests with and without
`watermark`, run alternately on one engine (medians of --repeats), greedy and sampled, at
each batch size; and how strongly the output is marked (the median z-score of the
watermarked outputs, and of the plain ones as a control).

    python tools/bench_watermark.py --batch-sizes 1,32 --output-len 128 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera import LLM, SamplingParams

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how rainbows form.",
           "Describe your ideal weekend.", "Give advice to a new gardener.",
           "What makes a good cup of coffee?", "Summarise the history of the bicycle.",
           "Plan a three-day trip to the mountains.", "Why do cats purr?"]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[float]]:
    """Output tokens per second, and each output's z-score."""
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    scores = [llm.detect_watermark(o.outputs[0].token_ids, prompt=o.prompt_token_ids).z_score for o in outs]
    return tokens / elapsed, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, show_progress=False)
    chats = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    print(f"{'batch':>5} {'sampling':>8} {'plain tok/s':>12} {'marked tok/s':>13} {'ratio':>6} "
          f"{'z marked':>9} {'z plain':>8}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [chats[i % len(chats)] for i in range(batch)]
        for name, sampling in (("greedy", dict(temperature=0.0)), ("t=0.8", dict(temperature=0.8))):
            def params(mark: bool) -> list[SamplingParams]:
                return [SamplingParams(max_new_tokens=args.output_len, ignore_eos=True, seed=i, watermark=mark,
                                       **sampling) for i in range(batch)]
            run(llm, prompts[:1], params(True)[:1])  # warm the caches
            speeds: dict[bool, list[float]] = {False: [], True: []}
            zs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for mark in (False, True):
                    speed, scores = run(llm, prompts, params(mark))
                    speeds[mark].append(speed)
                    zs[mark] += scores
                    llm.reset_prefix_cache()
            plain, marked = statistics.median(speeds[False]), statistics.median(speeds[True])
            print(f"{batch:>5} {name:>8} {plain:>12.1f} {marked:>13.1f} {marked / plain:>6.3f} "
                  f"{statistics.median(zs[True]):>9.2f} {statistics.median(zs[False]):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
