"""MXFP4 expert stacks (gpt-oss's format) kept packed: both kernels' projections (float32:
mxfp4_linear_avx2.c; bf16 on AVX512: mxfp4_linear.c, with its exponent-added scales and its
float32 path for rows with extreme scales) against the dequantized weight in float64
(every code, tiny and huge scales, 0 to 33 tokens, odd block counts, with and without a
bias), the expert builder against the dequantizing reference, and the stacks' loader under
tensor parallelism (whole blocks per rank)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.distributed.parallel import TensorParallelError
from tessera.ops.activation import clamped_swiglu_ref
from tessera.ops.cpu import moe_mxfp4 as cpu_moe_mxfp4
from tessera.ops.cpu.linear import has_amx
from tessera.ops.moe_mxfp4 import Mxfp4Experts, mxfp4_experts_ref
from tessera.ops.registry import OpTarget
from tessera.weights.mxfp4 import dequantize_mxfp4

UNAVAILABLE = "; ".join(cpu_moe_mxfp4._KERNEL.check(None)) or None
needs_kernel = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def random_stack(*lead: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 131, (*lead, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


@needs_kernel
@pytest.mark.parametrize("tokens", [0, 1, 4, 33])
@pytest.mark.parametrize("rows, groups", [(64, 2), (7, 3), (130, 91)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_projection_matches_the_dequantized_weight(tokens, rows, groups, with_bias):
    blocks, scales = random_stack(rows, groups=groups, seed=rows + groups)
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, low and high nibble
    scales[0, 0], scales[-1, -1] = 0, 140                      # 2^-127 (subnormal) and 2^13
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, groups * 32, generator=g)
    bias = torch.randn(rows, generator=g) if with_bias else None
    got = cpu_moe_mxfp4.mxfp4_linear(x, blocks, scales, bias)
    want = F.linear(x.double(), dequantize_mxfp4(blocks, scales, torch.float64), None if bias is None else bias.double())
    assert got.shape == (tokens, rows) and got.dtype == torch.float32
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-5)
    # bf16 input: its own kernel on AVX512 CPUs (the float32 one elsewhere); float32 sums of
    # exact products, rounded to bf16 at the end
    x16 = x.bfloat16()
    want16 = F.linear(x16.double(), dequantize_mxfp4(blocks, scales, torch.float64), None if bias is None else bias.double())
    half = cpu_moe_mxfp4.mxfp4_linear(x16, blocks, scales, bias)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), want16, atol=2e-5 * scale, rtol=2 ** -8)


@needs_kernel
@pytest.mark.skipif(bool(cpu_moe_mxfp4._BF16_KERNEL.check(None)), reason="no AVX512 kernel here")
@pytest.mark.parametrize("low, high", [(118, 131), (0, 3), (250, 255)], ids=["typical", "tiny", "huge"])
def test_bf16_kernel_scales_exactly_whatever_the_scale(low, high):
    """Scales added to the weights' exponents where every result stays a normal bf16, else
    applied to each block's float32 sums: float32 output within float32 summation error."""
    rows, groups, tokens = 33, 5, 3
    blocks, _ = random_stack(rows, groups=groups, seed=7)
    scales = torch.randint(low, high, (rows, groups), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    scales[0] = 127  # one ordinary row among the extreme ones
    x = torch.randn(tokens, groups * 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = torch.empty(tokens, rows)
    assert cpu_moe_mxfp4._BF16_KERNEL(x.data_ptr(), blocks.data_ptr(), scales.data_ptr(), None, out.data_ptr(),
                                      tokens, rows, groups, 2) == 0
    want = F.linear(x.double(), dequantize_mxfp4(blocks, scales, torch.float64))
    # each row against its own magnitude (rows' scales differ by up to 2^250)
    err = (out.double() - want).abs() / want.abs().amax(dim=0, keepdim=True).clamp_min(1e-300)
    assert torch.isfinite(out).all() or low > 200  # 2^125 x 6 x sums may overflow float32
    assert (err[:, torch.isfinite(out).all(0)] < 1e-5).all(), err.max()


@pytest.mark.skipif(bool(cpu_moe_mxfp4._BF16_KERNEL.check(None)), reason="no AVX512 kernel here")
def test_dequantized_weights_are_exact_and_extreme_scales_are_refused():
    blocks, scales = random_stack(40, groups=3, seed=5)
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, low and high nibble
    scales[1, 2], scales[2, 0] = 2, 252                        # the exact range's ends
    out = torch.empty(40, 96, dtype=torch.bfloat16)
    assert cpu_moe_mxfp4._DEQUANTIZE(blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), 40, 3, 2) == 0
    assert torch.equal(out, dequantize_mxfp4(blocks, scales, torch.bfloat16))
    scales[5, 1] = 253
    out.zero_()
    assert cpu_moe_mxfp4._DEQUANTIZE(blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), 40, 3, 2) == 1
    assert not out.any()


@pytest.mark.skipif(bool(cpu_moe_mxfp4._BF16_KERNEL.check(None)) or not has_amx(), reason="no AVX512 kernel or AMX here")
@pytest.mark.parametrize("tokens", [cpu_moe_mxfp4.DEQUANTIZE_MIN_ROWS - 1, cpu_moe_mxfp4.DEQUANTIZE_MIN_ROWS, 70])
def test_a_prefills_rows_multiply_the_dequantized_weight_on_amx(tokens):
    """From DEQUANTIZE_MIN_ROWS rows a projection multiplies the exactly dequantized weight
    through torch's bf16 GEMM (AMX tiles): exact products and float32 sums there too."""
    blocks, scales = random_stack(96, groups=4, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    x, bias = torch.randn(tokens, 128, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    got = cpu_moe_mxfp4.mxfp4_linear(x, blocks, scales, bias)
    want = F.linear(x.double(), dequantize_mxfp4(blocks, scales, torch.float64), bias.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-5 * want.abs().max().item(), rtol=2 ** -8)


@needs_kernel
def test_kernel_refuses_a_mismatched_input():
    blocks, scales = random_stack(8, groups=2, seed=0)
    with pytest.raises(ValueError, match="takes 64"):
        cpu_moe_mxfp4.mxfp4_linear(torch.zeros(1, 96), blocks, scales, None)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_builder_matches_the_reference(tokens):
    e, hidden, inter, top_k = 4, 64, 96, 2
    w13, w2 = random_stack(e, 2 * inter, groups=hidden // 32, seed=1), random_stack(e, hidden, groups=inter // 32, seed=2)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu_ref(gate_up, 1.702, 7.0)

    want = mxfp4_experts_ref(x, w13, w2, weights, ids, b13, b2, act)
    got = cpu_moe_mxfp4.mxfp4_experts_cpu(x, w13, w2, weights, ids, b13, b2, act)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


def test_stacks_split_over_ranks_in_whole_blocks():
    e, hidden, inter = 2, 64, 64
    blocks13, scales13 = random_stack(e, 2 * inter, groups=hidden // 32, seed=3)
    blocks2, scales2 = random_stack(e, hidden, groups=inter // 32, seed=4)
    bias13 = torch.randn(e, 2 * inter)
    parts = []
    for rank in (0, 1):
        experts = Mxfp4Experts(hidden, inter, e, OpTarget("cpu", torch.float32, tp_size=2, tp_rank=rank), bias=True)
        for param, tensor in ((experts.w13_blocks, blocks13), (experts.w13_scales, scales13),
                              (experts.w2_blocks, blocks2), (experts.w2_scales, scales2), (experts.w13_bias, bias13)):
            param.weight_loader(param, tensor)
        parts.append(experts)
    # rank r: gate rows [32 r, 32 r + 32) then the same up rows; w2's block r of input features
    for rank, experts in enumerate(parts):
        rows = list(range(32 * rank, 32 * rank + 32)) + list(range(inter + 32 * rank, inter + 32 * rank + 32))
        assert torch.equal(experts.w13_blocks, blocks13[:, rows])
        assert torch.equal(experts.w13_bias, bias13[:, rows])
        assert torch.equal(experts.w2_scales, scales2[:, :, rank:rank + 1])
    with pytest.raises(ValueError, match="uint8"):
        parts[0].w2_scales.weight_loader(parts[0].w2_scales, scales2.float())
    with pytest.raises(TensorParallelError, match="whole blocks"):
        Mxfp4Experts(hidden, inter, e, OpTarget("cpu", torch.float32, tp_size=4, tp_rank=1))
