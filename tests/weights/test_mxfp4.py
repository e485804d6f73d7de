"""MXFP4 (gpt-oss's expert weights): tessera's decoder against transformers' on every code
and a spread of scales, shape errors named, and a checkpoint's `_blocks` / `_scales` pair
joined into one dense tensor by the pre-quantized reader (a missing half refused)."""
from __future__ import annotations

import pytest
import torch

from tessera.weights.mxfp4 import dequantize_mxfp4
from tessera.weights.prequantized import QuantizedCheckpointError, checkpoint_quantization


def random_parts(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def test_decodes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_parts((3, 10, 4), seed=0)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, in both nibbles
    ours = dequantize_mxfp4(blocks, scales, rows_per_chunk=7)  # chunks that end mid-tensor
    assert ours.shape == (3, 10, 128)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours.transpose(1, 2), theirs)
    # low nibble first: byte 0x21 holds 0.5 (code 1) then 1.0 (code 2), times 2^(scale - 127)
    one = dequantize_mxfp4(torch.full((1, 16), 0x21, dtype=torch.uint8), torch.tensor([129], dtype=torch.uint8))
    assert one.shape == (32,) and one[:2].tolist() == [2.0, 4.0]


@pytest.mark.parametrize("blocks, scales, match", [
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "do not match"),
    (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), "do not match"),
    (torch.zeros(2, 3, 16, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.uint8), "uint8"),
])
def test_malformed_parts_are_named(blocks, scales, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(blocks, scales)


class _Config:
    quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}


def test_checkpoint_parts_join_into_one_dense_tensor():
    quant = checkpoint_quantization(_Config())
    blocks, scales = random_parts((2, 6, 3), seed=1)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    weights = [(f"{name}_scales", scales), ("model.layers.0.mlp.router.weight", torch.ones(2)),
               (f"{name}_blocks", blocks), (f"{name}_bias", torch.zeros(2, 6))]
    out = dict(quant.dequantized(weights, {n for n, _ in weights}))
    assert set(out) == {name, "model.layers.0.mlp.router.weight", f"{name}_bias"}
    # [E, out, in] stored, handed over as transformers' modules hold it: [E, in, out]; in bf16,
    # which holds every value exactly
    assert out[name].dtype == torch.bfloat16
    assert torch.equal(out[name].float(), dequantize_mxfp4(blocks, scales).transpose(1, 2))


def test_a_missing_half_is_refused():
    quant = checkpoint_quantization(_Config())
    blocks, _ = random_parts((2, 6, 3), seed=1)
    weights = [("model.layers.0.mlp.experts.down_proj_blocks", blocks)]
    names = {"model.layers.0.mlp.experts.down_proj_blocks", "model.layers.0.mlp.experts.down_proj_scales"}
    with pytest.raises(QuantizedCheckpointError, match="missing parts"):
        list(quant.dequantized(weights, names))
