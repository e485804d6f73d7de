"""Where a decode step's time goes on a GPU: torch.profiler's kernel table for eager decode
steps of a model (default: the llama-3-8b preset with dummy weights), at the given batch
sizes, after one step that lets the linears choose their kernels at that size as graph
capture does (the choices are printed). Kernel times are what a captured graph replays;
the gap between their sum and the graph's step time is launch overhead. Run by tools/gpu_run.sh profile."""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tessera import LLM, SamplingParams
from tessera.ops import kernel_tuning


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, or fp8 (e4m3) / fp8_e5m2: an 8-bit cache")
    p.add_argument("--rows", type=int, default=25, help="kernels listed per batch size")
    args = p.parse_args()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device=args.device, enforce_eager=True,
              async_scheduling=False, kv_cache_dtype=args.kv_cache_dtype, show_progress=False)
    engine = llm.engine
    # room to decode through every other prompt's prefill (at 256 rows the first prompts
    # decode for ~30 steps before the last is cached); aborted once profiled
    params = SamplingParams(max_tokens=engine.max_model_len - args.input_len, ignore_eos=True, temperature=0.0)
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = [f"{batch}-{i}" for i in range(batch)]
        for i, request_id in enumerate(ids):
            engine.add_request(request_id, [(7 * i + j) % 1000 + 10 for j in range(args.input_len)], params)
        # prefill chunks (and decode rows beside them) until every prompt is in the cache
        while any(engine.requests[i].num_computed_tokens < args.input_len for i in ids):
            engine.step(stream=False)
        sync()
        # one decode step with kernel tuning open: the linears at this row count take the
        # kernels a captured graph would (tessera/ops/kernel_tuning.py); eager otherwise
        measured = len(kernel_tuning.records())
        with kernel_tuning.kernel_tuning():
            engine.step(stream=False)
        for record in kernel_tuning.records()[measured:]:
            print(record.describe(), "| rejected:", record.rejected or "none")
        sync()
        with profile(activities=[ProfilerActivity.CUDA if args.device != "cpu" else ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step(stream=False)
            sync()
        for request_id in ids:
            engine.abort(request_id)
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in events)
        print(f"\nbatch {batch}, {args.input_len} in, {args.steps} decode steps: "
              f"{total / 1e3 / args.steps:.3f} ms of kernels a step")
        print("| kernel | calls a step | us a step | us a call | share |\n|---|---|---|---|---|")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.rows]:
            print(f"| {e.key[:80]} | {e.count / args.steps:.0f} | {e.self_device_time_total / args.steps:.0f} | "
                  f"{e.self_device_time_total / max(e.count, 1):.1f} | {e.self_device_time_total / total:.1%} |")


if __name__ == "__main__":
    main()
