"""RMSNorm with the residual add fused, in Triton: one program per row. At decode batch
sizes the torch builder is ~8 kernels per norm (65 norms a step for a 32-layer model),
each a launch and a pass over the row; this is one of each. Rounds where the torch op
does: the sum to the model dtype (it is the next residual), the normalised row to the
model dtype before a weight in that dtype (not before a float32 one: tessera/ops/norm.py)."""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options

MAX_BLOCK = 4096  # elements per chunk of a row; wider rows take several


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    global grid_dependency, rms  # module globals: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import grid_dependency, rms

    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, new_res_ptr, w_ptr, out_ptr, hidden, x_stride, res_stride,
                        eps, HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        grid_dependency.start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + row * x_stride
        # pass 1: sum of squares of the (rounded) sum; the sum is stored as the new residual
        sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            x = tl.load(x_row + start + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * res_stride + start + cols, mask=mask, other=0.0)
                x = rms.residual_sum(x, r)
                tl.store(new_res_ptr + row * hidden + start + cols, x, mask=mask)
            xf = x.to(tl.float32)
            sq += xf * xf
        rstd = rms.inverse_rms(tl.sum(sq, axis=0), hidden, eps)
        # pass 2: normalise (the row is in L1/L2 by now)
        src = new_res_ptr + row * hidden if HAS_RESIDUAL else x_row
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            x = tl.load(src + start + cols, mask=mask, other=0.0)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0)
            tl.store(out_ptr + row * hidden + start + cols,
                     rms.weighted(x, rstd, w, ROUND_NORMED).to(out_ptr.dtype.element_ty), mask=mask)

    return rms_norm_kernel


def matrix_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view with unit column stride (a copy only when there is none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


@register_op("rms_norm", name="triton_rms_norm", priority=20, devices=("cuda",), check=triton_missing)
def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    rows_x = matrix_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(out)
    rows_res = None if residual is None else matrix_rows(residual)
    if rows_x.shape[0] and hidden:
        block = min(MAX_BLOCK, 1 << (hidden - 1).bit_length())
        _kernel()[(rows_x.shape[0],)](
            rows_x, rows_res if rows_res is not None else rows_x,
            new_residual if new_residual is not None else out, weight.contiguous(), out, hidden,
            rows_x.stride(0), rows_res.stride(0) if rows_res is not None else 0, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            ROUND_NORMED=not (weight.dtype == torch.float32 and x.dtype != torch.float32),
            num_warps=4 if block <= 2048 else 8, **launch_options(x))
    return out, new_residual
