"""One gpt-oss-20b expert projection (5760 x 2880) per call, MXFP4 (tessera's CPU kernel)
beside bf16 (tessera's packed GEMM), cycling through 12 different matrices so neither is
served from cache (106 MB packed, 398 MB in bf16): the bytes a MoE decode step streams.
Run alone on a quiet machine: python tools/bench_mxfp4.py"""
import statistics
import time

import torch

from tessera.ops.cpu.moe_mxfp4 import mxfp4_linear
from tessera.ops.registry import OpTarget
from tessera.ops.linear import Linear
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
R, H, N = 5760, 2880, 12   # 12 different experts: 106 MB packed, 398 MB bf16: never cache-resident
mx = [(torch.randint(0,256,(R,H//32,16),dtype=torch.uint8,generator=g), torch.randint(118,130,(R,H//32),dtype=torch.uint8,generator=g)) for _ in range(N)]
lins = []
for _ in range(N):
    lin = Linear(H, R, OpTarget("cpu", torch.bfloat16))
    with torch.no_grad(): lin.weight.copy_(torch.randn(R, H, generator=g))
    lin.prepare_weights(); lins.append(lin)
def rounds(fn, reps=5):
    fn(0)
    ts=[]
    for _ in range(reps):
        t=time.perf_counter()
        for i in range(N): fn(i)
        ts.append((time.perf_counter()-t)/N)
    return statistics.median(ts)*1e3
for T in (1, 4, 32):
    x = torch.randn(T, H, generator=g).bfloat16()
    a = rounds(lambda i: mxfp4_linear(x, *mx[i], None))
    b = rounds(lambda i: lins[i](x))
    print(f"T={T:3d}  per expert matrix: mxfp4 {a:6.2f} ms ({8.8/a:5.1f} GB/s)  bf16 GEMM {b:6.2f} ms ({33.2/b:5.1f} GB/s)  mxfp4/bf16 {a/b:.2f}x")
