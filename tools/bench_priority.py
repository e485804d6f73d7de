"""Urgent requests under load, `--scheduling-policy fcfs` against `priority`, on the
default model: 24 long background requests (priority 1, 96 tokens each) fill a batch of 8;
five steps later 4 short urgent ones (priority 0, 16 tokens) arrive. Reported: the median
time and engine steps from their arrival to their last token, alternating the policies.

    python tools/bench_priority.py --repeats 2
"""
from __future__ import annotations

import argparse
import statistics
import time

from tessera import LLM, SamplingParams


def run(policy: str, model: str | None) -> tuple[float, float]:
    with LLM(model, show_progress=False, max_num_seqs=8, scheduling_policy=policy) as llm:
        engine = llm.engine
        by_priority = policy == "priority"
        background = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
        urgent = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
        for i in range(24):
            engine.add_request(f"bg{i}", f"Background task {i}: write a long essay about topic {i}.",
                               background, priority=1 if by_priority else 0)
        for _ in range(5):
            engine.step()
        started, steps, done = time.perf_counter(), 0, {}
        for i in range(4):
            engine.add_request(f"u{i}", f"Urgent question {i}: what is {i} plus {i}?", urgent, priority=0)
        while engine.has_unfinished():
            outputs = engine.step()
            steps += 1
            for out in outputs:
                if out.finished and out.request_id.startswith("u"):
                    done[out.request_id] = (time.perf_counter() - started, steps)
    return statistics.median(t for t, _ in done.values()), statistics.median(s for _, s in done.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeats):
        for policy in ("fcfs", "priority"):
            seconds, steps = run(policy, args.model)
            print(f"{policy:9s} urgent requests done {seconds:.2f} s / {steps:.0f} steps after arriving (median)",
                  flush=True)


if __name__ == "__main__":
    main()
