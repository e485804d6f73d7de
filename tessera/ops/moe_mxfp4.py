"""Mixture-of-experts stacks kept in MXFP4 (gpt-oss's checkpoint format, weights/mxfp4.py):
4.25 bits a weight instead of bf16's 16, so gpt-oss-20b's experts take ~11 GB, not ~39.

`Mxfp4Experts` holds, per stack, the checkpoint's blocks [E, rows, G, 16] and scales
[E, rows, G] (uint8; rows are output features, 32 G the input features), w13 with the
gate rows then the up rows. The `moe_experts` op with quant "mxfp4" takes each stack as a
(blocks, scales) pair. This reference builder dequantizes every expert a step uses, each
step: the oracle of the kernels (tessera/ops/cpu/moe_mxfp4.py; on CUDA, with bf16 or fp16
models, tessera/ops/triton/mxfp4_linear.py), not fast. Where no builder serves a target
(float32 on CUDA, a GPU without Triton), a model loads the experts dequantized
(`keeps_mxfp4_experts`).

Tensor parallelism splits each expert's intermediate features: whole w13 rows, and whole
blocks of w2's input features, so each rank's span must be a multiple of 32: gpt-oss's 2880
(90 blocks) splits over 2, 3, 5, 6, 9, 10, ... ranks, not over 4 or 8, which are refused.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.parallel import TensorParallelError, even_span
from tessera.ops.module import OpModule
from tessera.ops.moe import GATE, UP, copy_gate_up, copy_half, run_grouped
from tessera.ops.registry import OpLookupError, OpTarget, register_op
from tessera.ops.weights import copy_checked, make_param
from tessera.weights.lazy import narrow
from tessera.weights.mxfp4 import BLOCK, dequantize_mxfp4

Mxfp4Stack = tuple[torch.Tensor, torch.Tensor]  # (blocks [E, rows, G, 16], scales [E, rows, G])


Mxfp4Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def run_mxfp4_experts(linear: Mxfp4Linear, x: torch.Tensor, w13: Mxfp4Stack, w2: Mxfp4Stack,
                      weights: torch.Tensor, ids: torch.Tensor, b13: torch.Tensor | None,
                      b2: torch.Tensor | None, activation: Callable[[torch.Tensor], torch.Tensor] | None
                      ) -> torch.Tensor:
    """ops/moe.py's run_grouped over MXFP4 stacks, each projection `linear(rows, blocks,
    scales, bias)` of one expert's blocks and scales."""
    return run_grouped(x, weights, ids, w13[0].shape[0],
                       lambda rows, e, bias: linear(rows, w13[0][e], w13[1][e], bias),
                       lambda rows, e, bias: linear(rows, w2[0][e], w2[1][e], bias), b13, b2, activation)


def _dequantized_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize_mxfp4(blocks, scales, x.dtype), bias)


@register_op("moe_experts", name="torch_mxfp4_experts", priority=0, devices=("cpu",), quant=("mxfp4",))
def mxfp4_experts_ref(x: torch.Tensor, w13: Mxfp4Stack, w2: Mxfp4Stack, weights: torch.Tensor,
                      ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """grouped_experts_ref over MXFP4 stacks, each used expert dequantized to x's dtype."""
    return run_mxfp4_experts(_dequantized_linear, x, w13, w2, weights, ids, b13, b2, activation)


def mxfp4_experts_available(target: OpTarget) -> bool:
    """Whether some builder runs MXFP4 stacks on `target` (else they load dequantized)."""
    try:
        target.op("moe_experts", quant="mxfp4")
    except OpLookupError:
        return False
    return True


class Mxfp4Experts(OpModule):
    """MXFP4 stacks of `num_experts` gated experts, with a bias per projection where `bias`
    (in the model dtype). Checkpoint tensors: w13_blocks / w13_scales ([E, 2I, ...], gate rows
    then up rows), w2_blocks / w2_scales ([E, H, I / 32, ...]), w13_bias, w2_bias."""

    quant = "mxfp4"

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, target: OpTarget,
                 bias: bool = False):
        super().__init__()
        if hidden_size % BLOCK or intermediate_size % BLOCK:
            raise ValueError(f"MXFP4 experts need hidden ({hidden_size}) and intermediate ({intermediate_size}) "
                             f"sizes that are multiples of {BLOCK}")
        self.full_intermediate = intermediate_size
        self.span = even_span(intermediate_size, target.tp_rank, target.tp_size)
        if self.span.start % BLOCK or self.span.size % BLOCK:
            raise TensorParallelError(f"MXFP4 experts split their {intermediate_size} intermediate features in "
                                      f"blocks of {BLOCK}; {target.tp_size} ranks cannot take whole blocks")
        local, groups = self.span.size, hidden_size // BLOCK
        e = num_experts

        def param(shape: tuple[int, ...], halves: tuple = ()) -> nn.Parameter:
            return make_param(shape, torch.uint8, target.device, loader=self._load, shard_ids=halves)

        # (w13 whole, or its GATE and UP halves apart as llama.cpp stores them)
        self.w13_blocks = param((e, 2 * local, groups, 16), (GATE, UP))
        self.w13_scales = param((e, 2 * local, groups), (GATE, UP))
        self.w2_blocks, self.w2_scales = param((e, hidden_size, local // BLOCK, 16)), param((e, hidden_size, local // BLOCK))
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = make_param((e, 2 * local), target.dtype, target.device, loader=self._load,
                                       shard_ids=(GATE, UP))
            self.w2_bias = make_param((e, hidden_size), target.dtype, target.device)

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        """`--load-format dummy`: random codes, and scales of 2^-6 (weights within +-0.1,
        as the dummy loader keeps float weights small); biases zero."""
        for blocks, scales in self.stacks():
            blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=generator,
                                       device=blocks.device))
            scales.fill_(127 - 6)
        for bias in (self.w13_bias, self.w2_bias):
            if bias is not None:
                bias.zero_()

    def stacks(self) -> tuple[Mxfp4Stack, Mxfp4Stack]:
        return (self.w13_blocks, self.w13_scales), (self.w2_blocks, self.w2_scales)

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        """A whole stack from the checkpoint: this rank's span of the gate and up rows of
        w13 (and its bias), of w2's blocks of input features."""
        full = self.full_intermediate
        gate_up = param is self.w13_blocks or param is self.w13_scales or param is self.w13_bias
        if shard_id in (GATE, UP):  # one half of w13: [E, I, ...]
            if param is not self.w13_bias and tensor.dtype != torch.uint8:
                raise ValueError(f"MXFP4 blocks and scales are uint8, the checkpoint's are {tensor.dtype}")
            with torch.no_grad():
                copy_half(param.data, tensor, shard_id, full, self.span, "MXFP4 experts")
            return
        if gate_up:
            expected = (param.shape[0], 2 * full, *param.shape[2:])
        else:
            expected = (*param.shape[:2], full // BLOCK, *param.shape[3:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"MXFP4 experts: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        if param is not self.w13_bias and tensor.dtype != torch.uint8:
            raise ValueError(f"MXFP4 blocks and scales are uint8, the checkpoint's are {tensor.dtype}")
        with torch.no_grad():
            if gate_up:
                copy_gate_up(param.data, tensor, full, self.span, "MXFP4 experts")
            else:
                copy_checked(param.data, narrow(tensor, 2, self.span.start // BLOCK, self.span.size // BLOCK),
                             "MXFP4 experts")
