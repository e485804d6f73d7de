"""Multi-head latent attention's own ops on CPU (latent_attention.h): the per-head products of
a decode step's few tokens (`head_matmul`, up to HEAD_MATMUL_MAX_TOKENS: longer steps take
torch's batched GEMM, far faster there) and the column concat, each one C call, so that an
MLA decode step is kernels alone, which its kernel graph replays."""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.latent_attention import concat_columns_ref, head_matmul_ref
from tessera.ops.registry import register_op

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_HEAD_MATMUL = Kernel("latent_attention.c", "tessera_head_matmul",
                      (_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _INT, _INT), _INT,
                      fallback_source="latent_attention_avx2.c")
_CONCAT = Kernel("latent_attention.c", "tessera_concat_columns", (_P, _I64, _I64, _P, _I64, _I64, _P, _I64),
                 fallback_source="latent_attention_avx2.c")
# a decode graph's largest bucket: each weight row is read once for all the tokens; past it a
# prefill's tokens are better served by torch's (MKL's) batched GEMM
HEAD_MATMUL_MAX_TOKENS = 32
MAX_K = 1024  # the untransposed form's widest per-head input (latent_attention.h's HM_MAX_K)


@register_op("head_matmul", name="cpu_head_matmul", priority=10, devices=("cpu",), dtypes=(torch.bfloat16,),
             check=_HEAD_MATMUL.check)
def head_matmul(x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """head_matmul_ref's op for bf16 x [T, H, K] (each head's values adjacent) and w [H, K, N]
    ([H, N, K] transposed) with adjacent row values; within a unit of the last place."""
    heads = x.shape[1] if x.dim() == 3 else 0
    k, n = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
    if not (x.dim() == 3 and w.dim() == 3 and x.dtype == w.dtype == torch.bfloat16 and x.stride(2) == 1
            and w.stride(2) == 1 and w.shape[0] == heads and x.shape[2] == k
            and x.shape[0] <= HEAD_MATMUL_MAX_TOKENS and (transposed or k <= MAX_K)):
        return head_matmul_ref(x, w, transposed)
    tokens = x.shape[0]
    out = torch.empty((tokens, heads, n), dtype=torch.bfloat16)
    if tokens and heads and n and _HEAD_MATMUL(x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), w.stride(0),
                                               w.stride(1), out.data_ptr(), tokens, heads, k, n, int(transposed),
                                               torch.get_num_threads()):
        raise MemoryError("head_matmul: its scratch could not be allocated")
    return out


@register_op("concat_columns", name="cpu_concat_columns", priority=10, devices=("cpu",), check=_CONCAT.check)
def concat_columns(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """concat_columns_ref's op: 2-D a and b of one dtype and row count, rows any stride apart."""
    if not (a.dim() == b.dim() == 2 and a.dtype == b.dtype and a.shape[0] == b.shape[0]
            and (a.stride(1) == 1 or a.shape[1] <= 1) and (b.stride(1) == 1 or b.shape[1] <= 1)):
        return concat_columns_ref(a, b)
    out = torch.empty((a.shape[0], a.shape[1] + b.shape[1]), dtype=a.dtype)
    size = a.element_size()
    if out.numel():
        _CONCAT(a.data_ptr(), a.stride(0) * size, a.shape[1] * size, b.data_ptr(), b.stride(0) * size,
                b.shape[1] * size, out.data_ptr(), a.shape[0])
    return out
