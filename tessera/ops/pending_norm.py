"""A decoder layer's input norm left for the linear that reads it.

At decode's few rows an RMSNorm is a kernel of its own (two a layer, ~2 us each plus the
gap before the next on an H200: docs/benchmarks.md, session 30), though the linear after it
reads the same rows anyway. A layer whose attention and MLP pass their input to one linear
each (`input_to_one_linear`) hands them a `PendingNorm` instead of normalised rows, where
the `rms_norm_linear` op exists (CUDA with Triton: the few-row linear normalises the rows
as it loads them, where that measures faster). Elsewhere layers never build one, and a
linear that cannot fuse it (LoRA on the layer) computes the norm first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tessera.ops.norm import RMSNorm


@dataclass
class PendingNorm:
    """norm(x + residual), not yet computed; `next_residual()` is x + residual once a
    linear has read it (x itself without a residual)."""
    norm: RMSNorm
    x: torch.Tensor
    residual: torch.Tensor | None
    _sum: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        """The normalised rows, by the norm's own op."""
        if self.residual is None:
            self._sum = self.x
            return self.norm(self.x)
        out, self._sum = self.norm(self.x, self.residual)
        return out

    @property
    def fusable(self) -> bool:
        """Whether the norm is RMSNorm's own computation (its weight and eps say all of it),
        which a fused op can apply; a subclass computing otherwise is run as itself."""
        return type(self.norm).forward is RMSNorm.forward

    def through(self, norm_linear: Callable, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The rows through a linear by the fused op (`rms_norm_linear`'s signature)."""
        out, self._sum = norm_linear(self.x, self.residual, self.norm.weight, self.norm.eps, weight, bias)
        return out

    def next_residual(self) -> torch.Tensor:
        if self._sum is None:
            raise RuntimeError("a pending norm was never computed: the module given it did not pass it to a linear")
        return self._sum


def input_to_one_linear(module: nn.Module) -> bool:
    """Whether `module`'s forward passes its input to one linear and nothing else, as the
    class defining that forward declares (`input_to_one_linear = True` in its own body: a
    subclass overriding forward does not inherit the claim)."""
    for cls in type(module).__mro__:
        if "forward" in vars(cls):
            return bool(vars(cls).get("input_to_one_linear", False))
    return False


def can_fuse_input_norms(attention: nn.Module, mlp: nn.Module) -> bool:
    """Whether a decoder layer may hand its attention's and MLP's input norms to their first
    linears (`qkv_proj`, `gate_up_proj`): both declare `input_to_one_linear` and both linears
    have the fused op."""
    return all(input_to_one_linear(m) and getattr(getattr(m, linear, None), "fuses_input_norm", False)
               for m, linear in ((attention, "qkv_proj"), (mlp, "gate_up_proj")))
