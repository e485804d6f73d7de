"""Time one mixture-of-experts layer through each CPU `moe_experts` builder that runs here.

    python tools/bench_moe_layer.py [--experts 128 --top-k 8 --hidden 2048 --width 768]

Defaults are Qwen3-30B-A3B's shapes. Routing is random (a dummy-weight model's router picks
far less varied experts), and four layers' stacks are used in turn, so the weights come
from memory as in a real decode step. Medians in ms, at 1 / 8 / 64 / 512 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.ops.moe import softmax_topk_ref
from tessera.ops.registry import OpSpec, builders

BUILDERS = ("torch_grouped_experts", "cpu_packed_experts", "cpu_int8_experts", "cpu_int4_experts")
LAYERS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    e, h, i = args.experts, args.hidden, args.width
    g = torch.Generator().manual_seed(0)
    raw = [((torch.randn(e, 2 * i, h, generator=g) * 0.02).bfloat16(),
            (torch.randn(e, h, i, generator=g) * 0.02).bfloat16()) for _ in range(LAYERS)]
    print(f"{e} experts, top {args.top_k}, hidden {h}, width {i}, {args.threads} threads; median ms")
    print("| builder | 1 token | 8 | 64 | 512 |\n| --- | --- | --- | --- | --- |")
    for name in BUILDERS:
        builder = next(b for b in builders("moe_experts") if b.name == name)
        if builder.rejections(OpSpec("moe_experts", "cpu", torch.bfloat16, quant=builder.quant[0])):
            continue
        prepare = builder.prepare or (lambda w: w)
        stacks = [(prepare(w13), prepare(w2)) for w13, w2 in raw]
        cells = []
        for tokens in (1, 8, 64, 512):
            x = torch.randn(tokens, h, generator=g).bfloat16()
            routes = [softmax_topk_ref(torch.randn(tokens, e, generator=g), args.top_k, True) for _ in range(LAYERS)]
            for layer in range(LAYERS):  # warm: kernels built, first-touch faults taken
                builder.impl(x, *stacks[layer], *routes[layer])
            times = []
            for rep in range(6 if tokens >= 512 else 12):
                layer = rep % LAYERS
                start = time.perf_counter()
                builder.impl(x, *stacks[layer], *routes[layer])
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        del stacks


if __name__ == "__main__":
    main()
