"""The CPU linear ops that run on this CPU (bf16, int8, int4) over the default model's 211
weight matrices (30 layers x q, k, v, o, gate, up, down + the LM head; int4 runs the LM head
in int8, as the engine does), called as the engine calls them in a decode step (the
registered ops, so the AMX builds run from the rows where the engine takes them, and the
int8 / int4 kernels take 8-bit x at 4-32 rows where their build has it; a prompt's step
keeps exact x, as at 1-3 rows or from 33), with the weights prepared and in
huge pages as the engine holds them: milliseconds per pass at each row count, medians, the
kernels interleaved so they share the host's state.

    python tools/bench_cpu_gemm.py --rows 1,2,8,32 --repeats 15 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.cpu import linear_int4 as cpu_int4
from tessera.ops.cpu import linear_int8 as cpu_int8
from tessera.ops.cpu.build import unavailable_reason
from tessera.runner.huge_pages import empty_huge_like

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocab 49152
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, VOCAB = 30, 49152


def _huge(t: torch.Tensor) -> torch.Tensor:
    out = empty_huge_like(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,8,32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).bfloat16() for n, k in LAYER_SHAPES] * LAYERS
    weights.append(torch.randn(VOCAB, 576, generator=g).bfloat16())
    torch.set_num_threads(args.threads)  # the ops run with torch's thread count, as in the engine
    kernels = {}  # name -> ((op, prepare) of the layers, (op, prepare) of the LM head)
    if unavailable_reason("gemm_bf16.c") is None:
        kernels["bf16"] = ((cpu_linear.gemm_linear, cpu_linear.pack_weight),) * 2
    elif unavailable_reason("gemm_bf16_avx2.c") is None:
        kernels["bf16 (avx2)"] = ((cpu_linear.gemm_linear_avx2, cpu_linear.pack_weight),) * 2
    int8 = (cpu_int8.gemm_int8_linear, cpu_int8.pack_int8)
    if not cpu_int8.kernel_unavailable():
        kernels[f"int8 ({cpu_int8._KERNEL.runnable_source()})"] = (int8, int8)
        if not cpu_int4.kernel_unavailable():
            kernels[f"int4 ({cpu_int4._KERNEL.runnable_source()})"] = (
                (cpu_int4.gemm_int4_linear, cpu_int4.pack_int4), int8)
    if not kernels:
        raise SystemExit("no packed GEMM kernel runs on this CPU")
    def per_matrix(name: str) -> list[tuple]:
        layer, head = kernels[name]
        return [layer] * (len(weights) - 1) + [head]
    packed = {name: [_huge(pack(w)) for w, (_, pack) in zip(weights, per_matrix(name))] for name in kernels}
    print(f"{len(weights)} matrices, {args.threads} threads, median of {args.repeats}"
          f"{', AMX from ' + str(cpu_linear.AMX_KERNEL_MIN_ROWS) + ' rows' if cpu_linear.amx_kernel_ready() else ''}")
    for m in (int(r) for r in args.rows.split(",")):
        calls = {name: [(op, torch.randn(m, w.shape[1], generator=g).bfloat16(), p)
                        for w, p, (op, _) in zip(weights, packed[name], per_matrix(name))] for name in kernels}
        times = {name: [] for name in kernels}
        for _ in range(args.repeats + 1):  # the first pass warms up and is dropped
            for name in kernels:
                start = time.perf_counter()
                for op, x, p in calls[name]:
                    op(x, p, None)
                times[name].append(time.perf_counter() - start)
        line = "  ".join(f"{name} {statistics.median(t[1:]) * 1e3:8.2f} ms" for name, t in times.items())
        print(f"rows {m:4d}: {line}", flush=True)


if __name__ == "__main__":
    main()
