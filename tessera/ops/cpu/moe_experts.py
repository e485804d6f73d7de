"""Expert stacks through the CPU's packed GEMM kernels: each expert's matrices laid out as
the dense builders lay out a weight (bf16 panels; int8 or int4 panels under --quantization),
and each projection of an expert a step uses run by that builder's kernels on the expert's
slice.

A decode step gives each chosen expert a row or a few, where torch's GEMM streams weights
at a third of the memory's rate and the packed kernels at most of it (ops/cpu/linear.py);
a prefill gives each expert many rows, which the same kernels run on AMX tiles where the
CPU has them.

Steps of up to DRIVEN_MAX_TOKENS tokens (a decode's) run the whole layer in one C call
(`run_layer`, moe_layer.c: the pairs sorted by expert, each expert's projections through the
same kernels, passed as function pointers, the activation, the weighted sum), so a mixture's
decode step is kernels alone, which its kernel graph replays (ops/cpu/graph.py), and pays no
Python per expert. The MXFP4 stacks' builder (ops/cpu/moe_mxfp4.py) runs through it too. In a
step padded to a graph's rows the padded rows run no experts (the step's live_rows, read by
the call). Longer steps, activations without a kernel and stacks a builder left unpacked take
the per-expert loop (ops/moe.py's run_grouped).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from tessera.ops.activation import ClampedSwiGLU, GeluTanhAndMul, ReluSquared
from tessera.ops.attention.metadata import live_rows_buffer
from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.cpu import linear_int4 as cpu_int4
from tessera.ops.cpu import linear_int8 as cpu_int8
from tessera.ops.cpu.activation import gelu_tanh_and_mul_kernel, silu_and_mul_kernel
from tessera.ops.cpu.gating import relu_squared_kernel
from tessera.ops.cpu.build import Kernel
from tessera.ops.moe import ExpertsImpl, register_per_expert

DRIVEN_MAX_TOKENS = 32  # a decode step's rows (the kernel graphs' largest bucket)
MAX_TOP_K = 64          # (moe_layer.c's per-token arrays)
PACKED_GEMM, MXFP4_BLOCKS = 0, 1  # moe_layer.c's stack kinds
GATED_KERNEL, CLAMPED_SWIGLU, UNGATED_KERNEL = 0, 1, 2  # and activation kinds

# a stack: kind, matrices, bytes per expert, scales (MXFP4), their bytes per expert, the kernel
# below wide_rows rows, the one from them, wide_rows; then its bias
_STACK = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
_LAYER = Kernel("moe_layer.c", "tessera_moe_experts",
                (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 5 + _STACK * 2
                + (ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_float)
                + (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int), ctypes.c_int)
_SCRATCH = Kernel("moe_layer.c", "tessera_moe_scratch_bytes", (ctypes.c_int64,) * 5, ctypes.c_int64)
# moe_layer.c's statuses past the GEMMs' own (1 shapes, 2 memory, 3 AMX refused)
_STATUS = {1: "a GEMM refused its shapes", 2: "a GEMM found no memory for working copies",
           3: "the OS refused AMX's tile state", 4: "an expert id is out of range",
           5: "the scratch buffer is too small"}

StackArgs = tuple  # _STACK's values but the bias: how moe_layer.c reads one stack


@functools.lru_cache(maxsize=None)
def layer_ready() -> bool:
    return not _LAYER.check(None)


def decode_sized(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *biases: torch.Tensor | None) -> bool:
    """Whether run_layer takes this step: a decode's few bf16 rows, float32 weights and int64
    ids from a routing op, bf16 biases."""
    return (x.dim() == 2 and 0 < x.shape[0] <= DRIVEN_MAX_TOKENS and x.dtype == torch.bfloat16
            and x.is_contiguous() and ids.dtype == torch.int64 and weights.dtype == torch.float32
            and ids.is_contiguous() and weights.is_contiguous() and ids.shape == weights.shape
            and ids.dim() == 2 and ids.shape[0] == x.shape[0] and 0 < ids.shape[1] <= MAX_TOP_K
            and all(b is None or (b.dtype == torch.bfloat16 and b.is_contiguous()) for b in biases)
            and layer_ready())


def activation_args(activation: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple | None:
    """moe_layer.c's (kind, kernel, alpha, limit) for `activation` (None: SwiGLU), or None
    where it has no kernel."""
    if isinstance(activation, ClampedSwiGLU):
        return CLAMPED_SWIGLU, None, activation.alpha, activation.limit
    if isinstance(activation, ReluSquared):  # (gateless experts: Nemotron 3's)
        kernel = relu_squared_kernel()
        return None if kernel is None else (UNGATED_KERNEL, kernel.address, 0.0, 0.0)
    kernel = (silu_and_mul_kernel() if activation is None
              else gelu_tanh_and_mul_kernel() if isinstance(activation, GeluTanhAndMul) else None)
    return None if kernel is None else (GATED_KERNEL, kernel.address, 0.0, 0.0)


def _packed_stack(stack: torch.Tensor, k: int, avx2: bool) -> StackArgs | None:
    """A prepared `stack` multiplied by rows of `k` features, or None where it is not in a
    packed layout (a stack left as loaded)."""
    if not stack.is_contiguous():
        return None
    kernels = None
    if stack.dtype == torch.bfloat16 and stack.dim() == 4 and stack.shape[2] * 2 == k:
        kernels = cpu_linear.packed_kernels(k, avx2)
    layouts = ((torch.int8, cpu_int8.panel_bytes(k), cpu_int8.packed_kernel),
               (torch.uint8, cpu_int4.PANEL_BYTES_PER_K * k, cpu_int4.packed_kernel))
    for dtype, row_bytes, kernel_of in layouts:
        if stack.dtype == dtype and stack.dim() == 3 and stack.shape[2] == row_bytes and k % 32 == 0:
            kernel = kernel_of()
            kernels = None if kernel is None else (kernel, kernel, 1)
    if kernels is None:
        return None
    small, wide, wide_rows = kernels
    return (PACKED_GEMM, stack.data_ptr(), stack.stride(0) * stack.element_size(), None, 0,
            small.address, wide.address, wide_rows)


def run_layer(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: int, inter: int,
              up: StackArgs, b13: torch.Tensor | None, down: StackArgs, b2: torch.Tensor | None,
              activation: tuple) -> torch.Tensor:
    """The layer in one moe_layer.c call (decode_sized steps): `up` and `down` each stack's
    StackArgs, `activation` activation_args'."""
    (tokens, hidden), top_k = x.shape, ids.shape[1]
    size = _SCRATCH._fn(tokens, top_k, experts, hidden, inter)  # (not a recorded call: its result is a size)
    scratch = torch.empty(size, dtype=torch.uint8)
    out = torch.empty_like(x)
    live = live_rows_buffer(tokens)  # (a padded graph step: its padded rows fetch no experts)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    status = _LAYER(x.data_ptr(), weights.data_ptr(), ids.data_ptr(), ptr(live), out.data_ptr(),
                    tokens, top_k, experts, hidden, inter, *up, ptr(b13), *down, ptr(b2), *activation,
                    scratch.data_ptr(), size, torch.get_num_threads())
    if status:
        raise (ValueError if status in (1, 4) else RuntimeError)(
            f"moe_layer.c: {_STATUS.get(status, f'status {status}')} (x {tuple(x.shape)}, {experts} experts)")
    return out


def driven(fallback: ExpertsImpl, avx2: bool) -> ExpertsImpl:
    """A moe_experts implementation over packed stacks that runs decode-sized steps in one
    moe_layer.c call and the rest through `fallback` (the per-expert loop)."""
    def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        if decode_sized(x, weights, ids, b13, b2):
            act = activation_args(activation)
            hidden, n13 = x.shape[1], w13.shape[1] * 16
            inter = n13 if act is not None and act[0] == UNGATED_KERNEL else n13 // 2
            up, down = _packed_stack(w13, hidden, avx2), _packed_stack(w2, inter, avx2)
            if (act is not None and up is not None and down is not None and w2.shape[1] * 16 == hidden
                    and w2.shape[0] == w13.shape[0]):
                return run_layer(x, weights, ids, w13.shape[0], inter, up, b13, down, b2, act)
        return fallback(x, w13, w2, weights, ids, b13, b2, activation)
    experts.__name__ = experts.__qualname__ = fallback.__name__
    experts.__doc__ = fallback.__doc__
    return experts


def _register(linear_builder: str, name: str, avx2: bool = False) -> ExpertsImpl:
    return register_per_expert(linear_builder, name, wrap=lambda impl: driven(impl, avx2))


packed_experts = _register("cpu_gemm_bf16", "cpu_packed_experts")
packed_experts_avx2 = _register("cpu_gemm_bf16_avx2", "cpu_packed_experts_avx2", avx2=True)  # CPUs without AVX512
int8_experts = _register("cpu_gemm_int8", "cpu_int8_experts")
int4_experts = _register("cpu_gemm_int4", "cpu_int4_experts")
