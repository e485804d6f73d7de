"""Time one mixture-of-experts layer through each CPU `moe_experts` builder that runs here.

    python tools/bench_moe_layer.py [--experts 128 --top-k 8 --hidden 2048 --width 768]
                                    [--tokens 1,8,64,512] [--loop]

Defaults are Qwen3-30B-A3B's shapes. Routing is random (a dummy-weight model's router picks
far less varied experts), and four layers' stacks are used in turn, so the weights come
from memory as in a real decode step. Medians in ms. `--loop` times each CPU builder's
per-expert loop beside it (what its one-call path, ops/cpu/moe_experts.py, replaces at up
to 32 tokens).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.ops.moe import per_expert, softmax_topk_ref
from tessera.ops.registry import OpSpec, builders

BUILDERS = ("torch_grouped_experts", "cpu_packed_experts", "cpu_int8_experts", "cpu_int4_experts")
# the CPU builders' linear builders, whose per-expert loop `--loop` times
LINEAR_OF = {"cpu_packed_experts": "cpu_gemm_bf16", "cpu_int8_experts": "cpu_gemm_int8",
             "cpu_int4_experts": "cpu_gemm_int4"}
LAYERS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,8,64,512", help="comma-separated token counts")
    parser.add_argument("--loop", action="store_true", help="also time each CPU builder's per-expert loop")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(args.threads)
    e, h, i = args.experts, args.hidden, args.width
    g = torch.Generator().manual_seed(0)
    raw = [((torch.randn(e, 2 * i, h, generator=g) * 0.02).bfloat16(),
            (torch.randn(e, h, i, generator=g) * 0.02).bfloat16()) for _ in range(LAYERS)]
    print(f"{e} experts, top {args.top_k}, hidden {h}, width {i}, {args.threads} threads; median ms")
    print("| builder | " + " | ".join(f"{t} token{'s' if t > 1 else ''}" for t in token_counts) + " |\n|"
          + " --- |" * (len(token_counts) + 1))
    for name in BUILDERS:
        builder = next(b for b in builders("moe_experts") if b.name == name)
        if builder.rejections(OpSpec("moe_experts", "cpu", torch.bfloat16, quant=builder.quant[0])):
            continue
        prepare = builder.prepare or (lambda w: w)
        stacks = [(prepare(w13), prepare(w2)) for w13, w2 in raw]
        runs = [(name, builder.impl)]
        if args.loop and name in LINEAR_OF:
            linear = next(b for b in builders("linear") if b.name == LINEAR_OF[name])
            runs.append((f"{name} (per-expert loop)", per_expert(linear.impl, "loop")))
        for label, impl in runs:
            cells = []
            for tokens in token_counts:
                x = torch.randn(tokens, h, generator=g).bfloat16()
                routes = [softmax_topk_ref(torch.randn(tokens, e, generator=g), args.top_k, True)
                          for _ in range(LAYERS)]
                cells.append(f"{time_layer(impl, x, stacks, routes, 6 if tokens >= 512 else 12) * 1e3:.2f}")
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        del stacks


def time_layer(impl, x: torch.Tensor, stacks: list, routes: list, repeats: int) -> float:
    """Median seconds of a call, each on the next layer's stacks, after a warm pass over them
    (kernels built, first-touch faults taken)."""
    for layer in range(LAYERS):
        impl(x, *stacks[layer], *routes[layer])
    times = []
    for rep in range(repeats):
        layer = rep % LAYERS
        start = time.perf_counter()
        impl(x, *stacks[layer], *routes[layer])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
