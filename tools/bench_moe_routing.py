"""Time the scored MoE routers on CPU: the one C call (ops/cpu/moe_routing.scored_topk)
against the torch builder it replaces (ops/moe.scored_topk_ref), at published router shapes.

    python tools/bench_moe_routing.py [--tokens 1,8,32,512] [--rounds 3]

The router's float32 GEMV is part of the call where the model keeps a float32 router
(DeepSeek's, GLM-4.5's, ERNIE's); LFM2-MoE's router passes bf16 logits. Medians in us of
each round, the rounds alternating the two sides.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.ops.cpu.moe_routing import scored_topk
from tessera.ops.moe import scored_topk_ref

# name -> (experts, hidden (0: bf16 logits are the input), k, router kwargs)
ROUTERS = {
    "glm-4.5-air": (128, 4096, 8, dict(sigmoid=True, renormalize=True, renorm_eps=1e-20)),
    "deepseek-v3": (256, 7168, 8, dict(sigmoid=True, groups=8, topk_group=4, renormalize=True, renorm_eps=1e-20,
                                       scaling=2.5)),
    "ernie-4.5-21b": (64, 2560, 6, dict(renormalize=True, renorm_floor=1e-12)),
    "lfm2-8b-a1b": (32, 0, 4, dict(sigmoid=True, renormalize=True, renorm_eps=1e-6, scaling=1.0)),
}


def median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name, (experts, hidden, k, kwargs) in ROUTERS.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            kwargs = {**kwargs, "bias": 0.1 * torch.randn(experts)}
            if hidden:
                x, weight = torch.randn(tokens, hidden).bfloat16(), 0.02 * torch.randn(experts, hidden)
                kwargs["router_weight"] = weight
            else:
                x = torch.randn(tokens, experts).bfloat16()
            ours, theirs = (lambda: scored_topk(x, k, **kwargs)), (lambda: scored_topk_ref(x, k, **kwargs))
            ours(), theirs()
            calls = max(5, 2000 // tokens)
            rounds = [(median_us(ours, calls), median_us(theirs, calls)) for _ in range(args.rounds)]
            print(f"{name:14s} {tokens:4d} tokens: call {' / '.join(f'{a:.0f}' for a, _ in rounds)} us, "
                  f"torch {' / '.join(f'{b:.0f}' for _, b in rounds)} us")


if __name__ == "__main__":
    main()
