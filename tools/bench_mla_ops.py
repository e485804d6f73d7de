"""Time multi-head latent attention's per-head products on CPU (ops/cpu/latent_attention.py's
head_matmul, W_UK and W_UV absorbed) against the torch einsum they replace, at DeepSeek
V2-Lite's and V3's shapes, and the LayerNorm kernel against torch's.

    python tools/bench_mla_ops.py [--tokens 1,8] [--rounds 3]

Medians in us of 200 calls, each round alternating the two sides.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.ops.cpu.latent_attention import head_matmul
from tessera.ops.cpu.norm import layer_norm
from tessera.ops.latent_attention import head_matmul_ref
from tessera.ops.norm import layer_norm_ref

# name -> (heads, qk_nope_head_dim, kv_lora_rank, v_head_dim)
SHAPES = {"deepseek-v2-lite": (16, 128, 512, 128), "deepseek-v3": (128, 128, 512, 128)}


def median_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def rounds(kernel, reference, count: int) -> str:
    sides = [(median_us(kernel), median_us(reference)) for _ in range(count)]
    return (f"kernel {'/'.join(f'{k:.0f}' for k, _ in sides)} us, "
            f"torch {'/'.join(f'{t:.0f}' for _, t in sides)} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    for name, (heads, nope, rank, v) in SHAPES.items():
        w = (0.05 * torch.randn(heads, nope + v, rank, generator=g)).bfloat16()
        for tokens in (int(t) for t in args.tokens.split(",")):
            q = torch.randn(tokens, heads, nope + 64, generator=g).bfloat16()
            out = torch.randn(tokens, heads, rank + 64, generator=g).bfloat16()
            for label, x, weight, transposed in (("W_UK", q[..., :nope], w[:, :nope], False),
                                                 ("W_UV", out[..., :rank], w[:, nope:], True)):
                timing = rounds(lambda: head_matmul(x, weight, transposed),
                                lambda: head_matmul_ref(x, weight, transposed), args.rounds)
                print(f"{name} {label}, {tokens} tokens: {timing}", flush=True)
    for hidden in (4096, 8192):
        weight = torch.randn(hidden, generator=g).bfloat16()
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=g).bfloat16()
            timing = rounds(lambda: layer_norm(x, weight, None, 1e-5), lambda: layer_norm_ref(x, weight, None, 1e-5),
                            args.rounds)
            print(f"layer_norm {hidden} wide, {tokens} rows: {timing}", flush=True)


if __name__ == "__main__":
    main()
