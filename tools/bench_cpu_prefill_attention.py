"""The CPU paged prefill attention kernel (paged_prefill_avx2.c; float32 FMAs, and on AMX hosts
its AMX build too) beside the pure-torch prefill (SDPA per sequence) in the same run, at the default model's shapes: 9 query / 3 KV
heads of 64, a bf16 cache of blocks of 16, 30 layers. A workload is `prompts` prompts of
`length` tokens prefilled together in steps of at most `chunk` tokens (shared evenly), as
the scheduler's chunked prefill does: later chunks attend over the cached earlier ones.
Milliseconds per whole prefill (all steps, 30 layers; medians) and attention GFLOP/s
(the causal work only: 4 * head size flops per query head and visible key).

    python tools/bench_cpu_prefill_attention.py --workloads 1x1000,1x2000,1x4000,32x128 --repeats 5
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from tessera.ops.attention import AttentionMetadata
from tessera.ops.attention.torch_paged import paged_prefill_ref
from tessera.ops.cpu import paged_prefill as cpu_paged_prefill

LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 9, 3, 64, 16


def _steps(prompts: int, length: int, chunk: int) -> list[list[tuple[int, int]]]:
    """(context length after the step, query length) per sequence, for every step."""
    per_step = max(1, chunk // prompts)
    steps, done = [], 0
    while done < length:
        n = min(per_step, length - done)
        done += n
        steps.append([(done, n)] * prompts)
    return steps


def _metadata(specs: list[tuple[int, int]], tables: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), block_tables=tables,
        seq_lens=torch.tensor([c for c, _ in specs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), num_decodes=0, num_decode_tokens=0,
        seq_lens_list=[c for c, _ in specs], query_lens_list=[n for _, n in specs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="1x1000,1x2000,32x128",
                        help="comma-separated PROMPTSxLENGTH")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per step (the scheduler's budget)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    problems = cpu_paged_prefill._KERNEL.check(None)
    if problems:
        raise SystemExit("; ".join(problems))
    torch.set_num_threads(args.threads)
    builds = [("kernel", functools.partial(cpu_paged_prefill._prefill, cpu_paged_prefill._KERNEL))]
    if cpu_paged_prefill.amx_kernel() is not None:
        builds.append(("amx", functools.partial(cpu_paged_prefill._prefill, cpu_paged_prefill.amx_kernel())))
    builds.append(("torch", paged_prefill_ref))
    print(f"{args.threads} threads, {LAYERS} layers, steps of <= {args.chunk} tokens, median of {args.repeats}")
    g = torch.Generator().manual_seed(0)
    scale = HEAD_SIZE ** -0.5
    for workload in args.workloads.split(","):
        prompts, length = (int(x) for x in workload.split("x"))
        blocks_per_seq = -(-length // BLOCK)
        num_blocks = prompts * blocks_per_seq
        tables = torch.randperm(num_blocks, generator=g).view(prompts, blocks_per_seq).to(torch.int32)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_SIZE)
        k_cache = torch.randn(shape, generator=g).bfloat16()
        v_cache = torch.randn(shape, generator=g).bfloat16()
        steps = []
        for specs in _steps(prompts, length, args.chunk):
            rows = sum(n for _, n in specs)
            q = torch.randn(rows, HEADS, HEAD_SIZE, generator=g).bfloat16()
            # the step's own K/V (the torch path reads them fresh for a first chunk)
            key = torch.randn(rows, KV_HEADS, HEAD_SIZE, generator=g).bfloat16()
            steps.append((q, key, _metadata(specs, tables)))
        flops = 4 * HEAD_SIZE * HEADS * LAYERS * prompts * length * (length + 1) / 2
        line = f"{prompts:3d} x {length:5d} ({len(steps)} steps)"
        for name, fn in builds:
            times = []
            for _ in range(args.repeats + 1):  # the first builds and warms
                start = time.perf_counter()
                for q, key, meta in steps:
                    for _ in range(LAYERS):
                        fn(q, key, key, k_cache, v_cache, meta, scale, None, None, None)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times[1:]) * 1e3
            line += f"  {name} {ms:9.1f} ms ({flops / ms / 1e6:5.1f} GFLOP/s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
