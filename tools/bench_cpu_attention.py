"""The CPU paged decode attention kernel (paged_decode_bf16.c, or its AVX2 twin) at the
default model's shapes: 9 query / 3 KV heads of 64, a bf16 (or, with --kv-cache-dtypes,
fp8) cache of blocks of 16 per layer,
blocks scattered as a serving engine leaves them. One pass is one call per layer over 30
layers with separate caches (as the engine's), so the cache is read from memory as in a
real decode step, not from the CPU's caches. Milliseconds per pass (medians) and the KV
bytes read per second.

    python tools/bench_cpu_attention.py --rows 1,32 --context 256,1000,4000 --repeats 9
    python tools/bench_cpu_attention.py --kv-cache-dtypes auto,fp8,fp8_e5m2   # side by side

To time another checkout's kernel, run it with PYTHONPATH pointing there (as a script, or
with `python -m` from outside both checkouts: the current directory comes before PYTHONPATH).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.ops.attention import AttentionMetadata
from tessera.ops.attention.kv_quant import kv_cache_torch_dtype, quantize_kv
from tessera.ops.cpu import paged_decode as cpu_paged_decode
from tessera.ops.cpu.paged_decode import paged_decode_bf16, paged_decode_fp8
from tessera.runner.huge_pages import empty_huge_like

LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 9, 3, 64, 16


def _case(rows: int, context: int, generator: torch.Generator, contiguous: bool = False,
          kv_dtype: torch.dtype = torch.bfloat16):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = rows * blocks_per_seq
    # scattered: decode steps grow every sequence a block at a time, and freed blocks come
    # back in any order; contiguous: each sequence's blocks in a row, as a fresh prefill's
    blocks = torch.arange(num_blocks) if contiguous else torch.randperm(num_blocks, generator=generator)
    order = blocks.view(rows, blocks_per_seq).to(torch.int32)
    lens = torch.full((rows,), context, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long), block_tables=order, seq_lens=lens,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32), num_decodes=rows,
        num_decode_tokens=rows, seq_lens_list=[context] * rows, query_lens_list=[1] * rows)
    caches = []
    for _ in range(LAYERS):
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_SIZE)
        pair = []
        for _ in range(2):
            x = torch.empty(shape, dtype=torch.bfloat16).normal_(generator=generator)
            cache = empty_huge_like(shape, kv_dtype)
            cache.copy_(quantize_kv(x, kv_dtype)) if kv_dtype != torch.bfloat16 else cache.copy_(x)
            pair.append(cache)
        caches.append(tuple(pair))
    query = torch.randn(rows, HEADS, HEAD_SIZE, generator=generator).bfloat16()
    return query, caches, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--context", default="256,1000,4000")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto (bf16), fp8, fp8_e5m2")
    args = parser.parse_args()
    problems = cpu_paged_decode._KERNEL.check(None)
    if problems:
        raise SystemExit("; ".join(problems))
    torch.set_num_threads(args.threads)
    print(f"{cpu_paged_decode._KERNEL.runnable_source()}, {args.threads} threads, "
          f"{LAYERS} layers, {args.layout} blocks, median of {args.repeats}")
    g = torch.Generator().manual_seed(0)
    scale = HEAD_SIZE ** -0.5
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            for name in args.kv_cache_dtypes.split(","):
                kv_dtype = kv_cache_torch_dtype(name) or torch.bfloat16
                kernel = paged_decode_bf16 if kv_dtype == torch.bfloat16 else paged_decode_fp8
                query, caches, meta = _case(rows, context, g, args.layout == "contiguous", kv_dtype)
                times = []
                for _ in range(args.repeats + 1):  # the first builds and warms
                    start = time.perf_counter()
                    for k, v in caches:
                        kernel(query, k, v, meta, scale)
                    times.append(time.perf_counter() - start)
                ms = statistics.median(times[1:]) * 1e3
                kv_bytes = LAYERS * rows * context * KV_HEADS * HEAD_SIZE * 2 * kv_dtype.itemsize
                print(f"rows {rows:4d}  context {context:6d}  kv {name:8s} {ms:9.2f} ms/pass  "
                      f"{kv_bytes / ms / 1e6:6.1f} GB/s")
                del caches


if __name__ == "__main__":
    main()
