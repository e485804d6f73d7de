"""The Triton kernels against the pure-torch ops (the attention ones in
triton_attention_cases.py, the linear-attention ones in triton_linear_attention_cases.py,
the few-row linear's in triton_skinny_cases.py),
run by tests/ops/test_triton_kernels.py in a subprocess with TRITON_INTERPRET=1 (Triton reads
it at import), on CPU tensors, or directly on a GPU when one is present
(`python -m tests.ops.triton_cases cuda`)."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tessera.ops.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from tessera.ops.norm import rms_norm_ref
from tessera.ops.linear_int4 import dequantize_int4, pack_int4_rows, quantize_int4
from tessera.ops.linear_int8 import quantize_int8, quantize_rows
from tessera.ops.rotary import rotary_ref
from tessera.ops.triton.activation import triton_gelu_tanh_and_mul, triton_silu_and_mul
from tessera.ops.triton.rms_norm import triton_rms_norm
from tessera.ops.triton.rotary import triton_rotary
from tessera.ops.triton.int4_linear import int4_linear, triton_int4_linear
from tessera.ops.triton.int8_linear import int8_linear, triton_int8_linear

from tests.ops.triton_attention_cases import ATTENTION_CHECKS
from tests.ops.triton_linear_attention_cases import LINEAR_ATTENTION_CHECKS
from tests.ops.triton_skinny_cases import SKINNY_CHECKS


def check_mxfp4(device: str) -> None:
    """gpt-oss's packed experts: the MXFP4 linear against float32 torch on the dequantized
    weight (every code, 1 to 70 rows in 16- and 64-row tiles, ragged outputs, in features a
    multiple of 64 or only of 32, bias), and the expert builder against the dequantizing
    reference; float16 (and bf16 on a GPU)."""
    from tessera.ops.activation import clamped_swiglu_ref
    from tessera.ops.moe_mxfp4 import mxfp4_experts_ref
    from tessera.ops.triton.mxfp4_linear import mxfp4_linear, triton_mxfp4_experts
    from tessera.weights.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(12)
    dtypes = (torch.float16,) if device == "cpu" else (torch.float16, torch.bfloat16)
    for dtype in dtypes:
        step = 2 ** -10 if dtype == torch.float16 else 2 ** -7
        for m, n, groups in ((1, 64, 2), (3, 40, 3), (17, 96, 4), (70, 48, 2)):
            blocks = torch.randint(0, 256, (n, groups, 16), dtype=torch.uint8, generator=g)
            blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code
            scales = torch.randint(120, 131, (n, groups), dtype=torch.uint8, generator=g)
            x = torch.randn(m, groups * 32, generator=g).to(dtype)
            for bias in (None, torch.randn(n, generator=g).to(dtype)):
                got = mxfp4_linear(x.to(device), blocks.to(device), scales.to(device),
                                   None if bias is None else bias.to(device)).cpu().float()
                want = F.linear(x.float(), dequantize_mxfp4(blocks, scales), None if bias is None else bias.float())
                assert (got - want).abs().max() <= step * want.abs().max() + 1e-3, (dtype, m, n, groups)
        e, hidden, inter = 4, 64, 96
        w13 = (torch.randint(0, 256, (e, 2 * inter, hidden // 32, 16), dtype=torch.uint8, generator=g),
               torch.randint(118, 128, (e, 2 * inter, hidden // 32), dtype=torch.uint8, generator=g))
        w2 = (torch.randint(0, 256, (e, hidden, inter // 32, 16), dtype=torch.uint8, generator=g),
              torch.randint(118, 128, (e, hidden, inter // 32), dtype=torch.uint8, generator=g))
        x = torch.randn(9, hidden, generator=g)
        weights = torch.softmax(torch.randn(9, 2, generator=g), -1)
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(9)])
        b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)

        def act(gate_up: torch.Tensor) -> torch.Tensor:
            return clamped_swiglu_ref(gate_up.float(), 1.702, 7.0).to(gate_up.dtype)

        want = mxfp4_experts_ref(x, w13, w2, weights, ids, b13, b2, act)
        on = (lambda t: t.to(device))
        got = triton_mxfp4_experts(on(x.to(dtype)), tuple(map(on, w13)), tuple(map(on, w2)), on(weights), on(ids),
                                   on(b13.to(dtype)), on(b2.to(dtype)), act).cpu().float()
        assert (got - want).abs().max() <= 4 * step * want.abs().max() + 1e-2, (dtype, (got - want).abs().max())


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float32: equal up to float32 rounding. bf16: within a bf16 step of the torch op on a
    GPU (each rounding matches torch's, to nearest even; float32 math may differ in the last
    bit), within a few under the interpreter, which rounds float32 -> bf16 toward zero, so
    chained roundings (sum, normalised row, product) drift a step each."""
    interpreted = got.device.type == "cpu"
    got = got.cpu()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
    else:
        err = (got.float() - want.float()).abs()
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -5 if interpreted else 2 ** -7,
                                   atol=1e-2 if interpreted else 1e-3,
                                   msg=lambda m: f"{what}: max error {err.max().item():.3g} at "
                                                 f"{divmod(err.argmax().item(), err.shape[-1])}, "
                                                 f"{(err > 0).sum().item()} of {err.numel()} differ\n{m}")


def check_pointwise(device: str) -> None:
    """RMSNorm (+ residual), the gated activations and rotary against the torch ops, in
    float32, bf16 and fp16, on strided inputs like the layers pass (q/k/gate-up views);
    rotary bit for bit."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for hidden in (64, 200, 5000):  # one chunk, a ragged one, several (MAX_BLOCK 4096)
            x = (torch.randn(7, hidden, generator=g) * 3).to(dtype)
            res = torch.randn(7, hidden, generator=g).to(dtype)
            w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
            want, want_res = rms_norm_ref(x, w, 1e-6, res)
            got, got_res = triton_rms_norm(x.to(device), w.to(device), 1e-6, res.to(device))
            _close(got, want, f"rms_norm {dtype} {hidden}")
            _close(got_res, want_res, f"rms_norm residual {dtype} {hidden}")
            plain, none = triton_rms_norm(x[:, :hidden].to(device), w.to(device), 1e-5)
            assert none is None
            _close(plain, rms_norm_ref(x, w, 1e-5)[0], f"rms_norm without residual {dtype}")
            w32 = torch.rand(hidden, generator=g) + 0.5 + 1e-4  # Gemma's float32 1 + w
            want, want_res = rms_norm_ref(x, w32, 1e-6, res)
            got, got_res = triton_rms_norm(x.to(device), w32.to(device), 1e-6, res.to(device))
            assert got.dtype == dtype
            _close(got, want, f"rms_norm float32 weight {dtype} {hidden}")
            if dtype != torch.float32:  # and no rounding before the weight: nearer the op than
                s = (x + res).float()    # to the same product with the row rounded first
                normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
                rounded_first = (w32 * normed.to(dtype).float()).to(dtype)
                off = [(got.cpu().float() - ref.float()).abs().mean().item() for ref in (want, rounded_first)]
                assert off[0] < off[1], f"rms_norm float32 weight {dtype} {hidden}: {off}"
        wide = (torch.randn(5, 2 * 1500 + 8, generator=g) * 4).to(dtype)
        gate_up = wide[:, 8:]  # a strided view: rows 3008 apart, 3000 wide
        for ours, ref in ((triton_silu_and_mul, silu_and_mul_ref), (triton_gelu_tanh_and_mul, gelu_tanh_and_mul_ref)):
            _close(ours(gate_up.to(device)), ref(gate_up), f"{ours.__name__} {dtype}")
        for heads, kv_heads, head_size in ((4, 2, 64), (3, 1, 24)):
            qkv = torch.randn(6, (heads + 2 * kv_heads) * head_size, generator=g).to(dtype)
            q, k = qkv[:, :heads * head_size], qkv[:, heads * head_size:(heads + kv_heads) * head_size]
            angles = torch.rand(6, head_size // 2, generator=g) * 6
            rows = torch.cat((angles.cos(), angles.cos(), angles.sin(), angles.sin()), dim=-1).to(dtype)
            cos, sin = rows[:, None, :head_size], rows[:, None, head_size:]
            want_q, want_k = rotary_ref(q, k, cos, sin, head_size)
            got_q, got_k = triton_rotary(q.to(device), k.to(device), cos.to(device), sin.to(device), head_size)
            # exact: each product and sum rounded to bf16 as torch rounds them (rounding.py)
            for got, want, which in ((got_q, want_q, "q"), (got_k, want_k, "k")):
                diff = (got.cpu() != want).sum().item()
                assert diff == 0, f"rotary {which} {dtype} {head_size}: {diff} of {want.numel()} values differ"


def check_bf16_rounding(device: str) -> None:
    """rounding.rounded to bf16 equals torch's float32 -> bf16 conversion bit for bit: ties,
    the largest values (to inf), denormals, inf, and NaN whatever its payload (a GPU's
    canonical NaN 0x7fffffff must not carry into the sign)."""
    import triton
    import triton.language as tl

    global rounding  # a module global: the interpreter does not see this function's locals
    from tessera.ops.triton import rounding

    @triton.jit
    def round_all(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + i, mask=i < n)
        tl.store(out_ptr + i, rounding.rounded(x, True, tl.bfloat16), mask=i < n)

    g = torch.Generator().manual_seed(11)
    special = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000,
                            0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x80000001,
                            0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0],
                           dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
            & -65536) | 0x8000  # exactly halfway between two bf16 values
    anything = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([special, ties, anything]).view(torch.float32)
    out = torch.empty_like(x, device=device)
    round_all[(triton.cdiv(x.numel(), 1024),)](x.to(device), out, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16).float()
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan()), "NaN"
    ok = want.isnan() | (got.view(torch.int32) == want.view(torch.int32))
    bad = (~ok).nonzero().flatten()
    assert bad.numel() == 0, [(hex(x[i].view(torch.int32).item() & 0xFFFFFFFF), got[i].item(), want[i].item())
                              for i in bad[:5].tolist()]


def check_int4_linear(device: str) -> None:
    """The int4 linear against float32 torch on the dequantized weight: 1 to 70 rows (16- and
    64-row tiles, ragged), ragged out features, in features a multiple of 64 or only of 32,
    bias, a strided input, leading dims; float16 (and bf16 on a GPU); float weights (not
    quantizable) pass through."""
    g = torch.Generator().manual_seed(11)
    dtypes = (torch.float16,) if device == "cpu" else (torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for m, n, k in ((1, 64, 64), (3, 40, 96), (17, 96, 192), (70, 48, 64)):
            w = torch.randn(n, k, generator=g) / k ** 0.5
            packed = pack_int4_rows(w).to(device)
            exact = dequantize_int4(*quantize_int4(w))
            wide = torch.randn(m, k + 8, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            for x in (wide[:, :k].contiguous(), wide[:, 8:]):
                for bias in (None, b):
                    want = F.linear(x.float(), exact, None if bias is None else bias.float())
                    got = triton_int4_linear(x.to(device), packed, None if bias is None else bias.to(device))
                    assert got.shape == (m, n) and got.dtype == dtype
                    torch.testing.assert_close(got.cpu().float(), want, rtol=2 ** -7, atol=4e-3,
                                               msg=lambda e: f"{dtype} {m}x{n}x{k} bias {bias is not None}: {e}")
    x = torch.randn(2, 3, 64, generator=g).to(torch.float16)
    w = torch.randn(24, 64, generator=g)
    got = int4_linear(x.to(device), pack_int4_rows(w).to(device), None)
    want = F.linear(x.float(), dequantize_int4(*quantize_int4(w)))
    torch.testing.assert_close(got.cpu().float(), want, rtol=2 ** -7, atol=4e-3)
    assert int4_linear(x[:0].to(device), pack_int4_rows(w).to(device), None).shape == (0, 3, 24)
    kept = torch.randn(16, 40, generator=g).to(torch.float16)  # 40 in features: not quantizable
    assert pack_int4_rows(kept) is kept
    x40 = torch.randn(2, 40, generator=g).to(torch.float16)
    torch.testing.assert_close(triton_int4_linear(x40.to(device), kept.to(device), None).cpu().float(),
                               F.linear(x40.float(), kept.float()), rtol=2 ** -7, atol=4e-3)


def check_int8_linear(device: str) -> None:
    """The int8 linear against float32 torch on the dequantized weight: 1 to 70 rows, ragged
    out features and in features (not a multiple of the tile), bias, a strided input,
    leading dims; float16 (and bf16 on a GPU)."""
    g = torch.Generator().manual_seed(12)
    dtypes = (torch.float16,) if device == "cpu" else (torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for m, n, k in ((1, 64, 64), (3, 40, 100), (17, 96, 192), (70, 48, 33)):
            w = torch.randn(n, k, generator=g) / k ** 0.5
            q, s = quantize_int8(w)
            exact = q.float() * s.unsqueeze(1)
            packed = quantize_rows(w).to(device)
            wide = torch.randn(m, k + 8, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            for x in (wide[:, :k].contiguous(), wide[:, 8:]):
                for bias in (None, b):
                    want = F.linear(x.float(), exact, None if bias is None else bias.float())
                    got = triton_int8_linear(x.to(device), packed, None if bias is None else bias.to(device))
                    assert got.shape == (m, n) and got.dtype == dtype
                    torch.testing.assert_close(got.cpu().float(), want, rtol=2 ** -7, atol=4e-3,
                                               msg=lambda e: f"{dtype} {m}x{n}x{k} bias {bias is not None}: {e}")
    x = torch.randn(2, 3, 64, generator=g).to(torch.float16)
    w = torch.randn(24, 64, generator=g)
    q, s = quantize_int8(w)
    got = int8_linear(x.to(device), quantize_rows(w).to(device), None)
    torch.testing.assert_close(got.cpu().float(), F.linear(x.float(), q.float() * s.unsqueeze(1)), rtol=2 ** -7,
                               atol=4e-3)
    assert int8_linear(x[:0].to(device), quantize_rows(w).to(device), None).shape == (0, 3, 24)


def check_quantized_experts(device: str) -> None:
    """The int8 / int4 expert builders (each expert's projections through the linears above)
    against the reference builders on the same prepared stacks: 1 token and 12, float16."""
    from tessera.ops.moe import softmax_topk_ref
    from tessera.ops.moe_quantized import int4_experts_ref, int8_experts_ref
    from tessera.ops.registry import builders
    from tessera.ops.triton.moe_experts import int4_experts, int8_experts

    g = torch.Generator().manual_seed(13)
    prepare = {b.name: b.prepare for b in builders("moe_experts")}
    for name, got_fn, want_fn in (("triton_int8_experts", int8_experts, int8_experts_ref),
                                  ("triton_int4_experts", int4_experts, int4_experts_ref)):
        w13 = prepare[name](torch.randn(4, 128, 64, generator=g) / 8)
        w2 = prepare[name](torch.randn(4, 64, 64, generator=g) / 8)
        for tokens in (1, 12):
            x = torch.randn(tokens, 64, generator=g).to(torch.float16)
            weights, ids = softmax_topk_ref(torch.randn(tokens, 4, generator=g), 2, True)
            want = want_fn(x.float(), w13, w2, weights, ids)
            got = got_fn(x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device))
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.cpu().float(), want, rtol=2 ** -6, atol=8e-3, msg=lambda e: f"{name}: {e}")


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for check in ATTENTION_CHECKS + LINEAR_ATTENTION_CHECKS:
        check(dev)
    check_mxfp4(dev)
    check_pointwise(dev)
    check_bf16_rounding(dev)
    for check in SKINNY_CHECKS:
        check(dev)
    check_int4_linear(dev)
    check_int8_linear(dev)
    check_quantized_experts(dev)
    print("triton kernels OK")
