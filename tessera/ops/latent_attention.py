"""The two ops multi-head latent attention (models/deepseek/mla.py) needs beside the shared
ones: each head's rows times its own matrix (the absorbed key and value up-projections), and
two row blocks side by side (the latent query or key and its rotary part). Torch builders
here; the CPU ones (ops/cpu/latent_attention.py) make an MLA decode step kernels alone."""
from __future__ import annotations

import torch

from tessera.ops.registry import register_op


@register_op("head_matmul", name="torch_head_matmul", priority=0)
def head_matmul_ref(x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x [T, H, K] (a view: heads any stride apart) times each head's matrix: w [H, K, N], or
    with `transposed` w [H, N, K] times its transpose -> [T, H, N], contiguous (transformers'
    einsums, whose result may be a permuted view)."""
    return torch.einsum("thk,hnk->thn" if transposed else "thk,hkn->thn", x, w).contiguous()


@register_op("concat_columns", name="torch_concat_columns", priority=0)
def concat_columns_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[R, n1] and [R, n2] -> [R, n1 + n2]."""
    return torch.cat((a, b), dim=-1)
