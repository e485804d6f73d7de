"""Linear layers at decode's few rows (1-16), in Triton, chosen over cuBLAS by measurement.

At batch 1 a decode step is a string of matrix-vector products: every weight byte is read
once and used once, so each linear should run at the memory's copy bandwidth. cuBLAS does
not always: on the H100 its kernel for Llama-3-8B's o_proj (4096 x 4096) reached 1.6 of
2.96 TB/s, and its split-K reductions took 0.12 ms of a 6.9 ms step. Here the product is
computed transposed, W [N, K] @ x^T [K, rows padded to 16], so the weight's rows fill the
matrix unit's wide side; tiles of the weight stream through a multi-stage pipeline, and
the K dimension splits across programs when N alone gives too few to fill the chip
(fp32 partial sums, added up by the last of a tile's programs to finish: semaphores.py,
no second kernel). Launched with PDL, each program hints its first stages of weight into L2
before waiting for the kernel before (prefetch.py).

Which tile, split and pipeline depth wins depends on the shape and the chip, so nothing is
guessed: the builder measures the candidates against cuBLAS (tessera/ops/kernel_tuning.py)
on each shape's first call during the warm-up before CUDA graphs are captured, and keeps
cuBLAS where no candidate beats it by 3%. Untuned shapes and more rows take cuBLAS.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.ops.kernel_tuning import TacticTable, tunes_up_to, tuning_open
from tessera.ops.registry import register_op
from tessera.ops.triton import semaphores
from tessera.ops.triton.activation import triton_gelu_tanh_and_mul, triton_silu_and_mul
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options
from tessera.ops.triton.rms_norm import matrix_rows, triton_rms_norm

MAX_ROWS = 16  # the rows one program covers (the matrix unit's narrow side)
# the gated activations applied while loading (the kernel's ACT codes: gating.py)
ACTIVATIONS = {None: 0, "silu_and_mul": 1, "gelu_tanh_and_mul": 2}


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int      # weight rows (outputs) per program
    block_k: int      # input columns per pipeline stage
    split_k: int = 1  # programs sharing one tile's K range
    num_warps: int = 4
    num_stages: int = 4

    @property
    def name(self) -> str:
        return (f"triton n{self.block_n} k{self.block_k} split{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}")


# (block_n, block_k, num_warps, num_stages): 16-32 KB of weight per stage, 2-4 stages in
# flight per program; 32-row tiles give a 4096-output layer one program per SM of an H100
TILES = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4))


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # module globals: the interpreter does not see this closure's names (fp8.py)
    global gating, grid_dependency, load_input, load_normed, load_sum, prefetch, rms
    from tessera.ops.triton import gating, grid_dependency, prefetch, rms

    @triton.jit
    def load_input(cols, k, K, mask, ACT: tl.constexpr):
        """Input columns k of the rows at `cols`; with ACT, a gated MLP's activation of
        the packed gate (columns k) and up (K + k) halves, rounded as the activation op
        rounds its output."""
        x = tl.load(cols + k, mask=mask, other=0.0)
        if ACT != 0:
            x = gating.gated(x, tl.load(cols + K + k, mask=mask, other=0.0), ACT).to(x.dtype)
        return x

    @triton.jit
    def load_sum(cols, res_cols, k, mask, HAS_RES: tl.constexpr):
        """Input columns k plus the residual's, rounded to the input dtype as the norm op
        rounds the sum (the next residual); the input alone without a residual."""
        x = tl.load(cols + k, mask=mask, other=0.0)
        if HAS_RES:
            x = rms.residual_sum(x, tl.load(res_cols + k, mask=mask, other=0.0))
        return x

    @triton.jit
    def load_normed(cols, res_cols, sum_cols, norm_w_ptr, k, K, mask, rstd, write_sum,
                    HAS_RES: tl.constexpr, ROUND_NORMED: tl.constexpr):
        """Input columns k as the RMSNorm op gives them (tessera/ops/norm.py): the sum
        with the residual times the rows' rstd, rounded before a weight in the input dtype,
        times the weight; the sum stored for the next residual where `write_sum`."""
        x = load_sum(cols, res_cols, k, mask, HAS_RES)
        if HAS_RES:
            if write_sum:
                tl.store(sum_cols + k, x, mask=mask)
        return rms.weighted(x, rstd[None, :], tl.load(norm_w_ptr + k, mask=k < K, other=0.0), ROUND_NORMED).to(x.dtype)

    # one compile for every row count and split (1 would be its own)
    @triton.jit(do_not_specialize=["M", "splits"])
    def skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, res_ptr, sum_ptr, norm_w_ptr, eps,
                      M, N, K, k_per_split, splits, x_stride, w_stride, out_stride, res_stride,
                      HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
                      HAS_RES: tl.constexpr, ROUND_NORMED: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        w_row_starts = w_ptr + n.to(tl.int64) * w_stride
        if PDL:  # the pipeline's first stages of weight into L2 while the kernel before finishes
            prefetch.rows_to_l2(w_row_starts, n_ok, k_begin, k_end, PREFETCH)
        grid_dependency.start(PDL)
        w_rows = w_row_starts[:, None]
        x_cols = x_ptr + m.to(tl.int64)[None, :] * x_stride
        res_cols = res_ptr + m.to(tl.int64)[None, :] * res_stride
        sum_cols = sum_ptr + m.to(tl.int64)[None, :] * K
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:  # RMSNorm's statistics: every program reads the whole rows (a few, from L2)
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                h = load_sum(x_cols, res_cols, k[:, None], m_ok[None, :] & (k < K)[:, None], HAS_RES).to(tl.float32)
                squares += tl.sum(h * h, axis=0)
            rstd = rms.inverse_rms(squares, K, eps)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:  # whole tiles: the weight loads need no mask
                w = tl.load(w_rows + k[None, :])
                x_mask = m_ok[None, :]
            else:
                k_ok = k < k_end
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x_mask = m_ok[None, :] & k_ok[:, None]
            if NORM:  # the first tile's programs (one per split) store the sum
                x = load_normed(x_cols, res_cols, sum_cols, norm_w_ptr, k[:, None], K, x_mask, rstd, tile == 0,
                                HAS_RES, ROUND_NORMED)
            else:
                x = load_input(x_cols, k[:, None], K, x_mask, ACT)
            acc = tl.dot(w, x, acc)
        mask = n_ok[:, None] & m_ok[None, :]
        last = True
        if PARTIAL:
            # fp32 partial sums [split, M, N]; the tile's last split to finish adds them up in
            # split order (the same sum whichever finishes last) and writes the output
            parts = part_ptr + m[None, :] * N + n[:, None]
            tl.store(parts + split * M * N, acc, mask=mask)
            tl.debug_barrier()  # every thread's stores precede the release below
            arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
            last = arrived == splits - 1
            if last:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in range(0, splits):  # past L1 (.cg): other SMs wrote them
                    acc += tl.load(parts + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        if last:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + m[None, :] * out_stride + n[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)

    return skinny_kernel


@dataclass
class InputNorm:
    """RMSNorm of the input rows, applied while loading them as tessera/ops/norm.py's op
    computes it: norm(x + residual) with `weight` and `eps`. Where there is a residual, the
    sum (the next residual) is written to `sum_out`: [rows, in features], contiguous."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    sum_out: torch.Tensor | None = None


def _check_norm(norm: InputNorm, rows: torch.Tensor, k: int, activation: str | None) -> None:
    if activation is not None:
        raise ValueError("skinny_linear: an input norm and a gated activation do not combine")
    if tuple(norm.weight.shape) != (k,):
        raise ValueError(f"skinny_linear: norm weight shape {tuple(norm.weight.shape)} for in features {k}")
    if norm.residual is not None:
        if norm.residual.numel() != rows.numel():
            raise ValueError(f"skinny_linear: residual shape {tuple(norm.residual.shape)} for input rows "
                             f"{tuple(rows.shape)}")
        out = norm.sum_out
        if out is None or tuple(out.shape) != tuple(rows.shape) or not out.is_contiguous() or out.dtype != rows.dtype:
            raise ValueError(f"skinny_linear: with a residual, sum_out must be a contiguous {tuple(rows.shape)} "
                             f"{rows.dtype} tensor")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: SkinnyConfig, activation: str | None = None,
                  norm: InputNorm | None = None) -> torch.Tensor:
    """x @ weight.T + bias for at most MAX_ROWS rows of x (any leading shape). With an
    `activation` ("silu_and_mul", "gelu_tanh_and_mul"), x is a gated MLP's packed gate-up
    rows (twice the weight's in features) and the product is of act(gate) * up, as that
    op computes it, applied while loading: a down projection without the activation's
    kernel. With a `norm`, the product is of the RMSNorm of x (plus a residual): a layer's
    input norm without its kernel."""
    k = weight.shape[1]
    if x.shape[-1] != (2 * k if activation else k):
        raise ValueError(f"skinny_linear: input width {x.shape[-1]} for in features {k}"
                         f"{' (gated: twice)' if activation else ''}")
    n = weight.shape[0]
    rows = matrix_rows(x)
    m = rows.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    if norm is not None:
        _check_norm(norm, rows, k, activation)
    residual = rows if norm is None or norm.residual is None else matrix_rows(norm.residual)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and not n and norm is not None and norm.residual is not None:
        torch.add(rows, residual, out=norm.sum_out)  # no program to store the sum
    if m and n:
        per_split = -(-k // config.split_k)
        k_per_split = -(-per_split // config.block_k) * config.block_k
        splits = max(-(-k // k_per_split), 1)
        tiles = -(-n // config.block_n)
        parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
        _kernel()[(tiles, splits)](
            rows, weight, bias if bias is not None else weight, out, parts, semaphores.counters(x.device, tiles),
            residual, norm.sum_out if norm is not None and norm.sum_out is not None else rows,
            weight if norm is None else norm.weight, 0.0 if norm is None else norm.eps,
            m, n, k, k_per_split, splits, rows.stride(0), weight.stride(0), out.stride(0), residual.stride(0),
            HAS_BIAS=bias is not None, PARTIAL=splits > 1, ACT=ACTIVATIONS[activation], NORM=norm is not None,
            HAS_RES=norm is not None and norm.residual is not None,
            ROUND_NORMED=norm is None or not (norm.weight.dtype == torch.float32 and x.dtype != torch.float32),
            EVEN=n % config.block_n == 0 and k % config.block_k == 0,
            BLOCK_N=config.block_n, BLOCK_M=MAX_ROWS, BLOCK_K=config.block_k,
            PREFETCH=1 << (config.num_stages * config.block_k - 1).bit_length(),
            num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return out.reshape(*x.shape[:-1], n)


def candidate_configs(n: int, k: int, num_sms: int) -> list[SkinnyConfig]:
    """Each tile unsplit, and split over K while the smaller split left SMs idle and every
    split keeps at least two stages of work."""
    configs = []
    for block_n, block_k, warps, stages in TILES:
        tiles = -(-n // block_n)
        split = 1
        while True:
            configs.append(SkinnyConfig(block_n, block_k, split, warps, stages))
            split *= 2
            if tiles * (split // 2) >= num_sms or -(-k // split) < 2 * block_k:
                break
    return configs


_TABLE = TacticTable("linear", reference="torch")
tunes_up_to(MAX_ROWS)
_CONFIGS: dict[str, SkinnyConfig] = {}


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Element by element within a few roundings of the output dtype (another summation
    order), scaled by the output's typical size where a sum cancels to near 0; a wrong
    or missing column fails."""
    got, want = got.float(), want.float()
    typical = want.square().mean().sqrt()
    return bool(((got - want).abs() <= 2 ** -6 * (want.abs() + typical) + 1e-6).all())


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _timer(device: torch.device) -> Callable[[dict[str, Callable[[], torch.Tensor]]], dict[str, float]]:
    from tessera.ops.triton.cuda_timer import time_cold

    return functools.partial(time_cold, device=device)


def _tune(key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          activation: str | None, norm: InputNorm | None, reference: Callable[[], torch.Tensor]) -> str:
    n, k = weight.shape
    candidates = {"torch": reference}
    for config in candidate_configs(n, k, _num_sms(x.device)):
        _CONFIGS[config.name] = config
        candidates[config.name] = functools.partial(skinny_linear, x, weight, bias, config, activation, norm)
    return _TABLE.tune(key, candidates, timer=_timer(x.device), agrees=_agrees)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None) -> torch.Tensor:
    """cuBLAS, after the activation's own kernel where there is one."""
    if activation == "silu_and_mul":
        x = triton_silu_and_mul(x)
    elif activation == "gelu_tanh_and_mul":
        x = triton_gelu_tanh_and_mul(x)
    return F.linear(x, weight, bias)


def _choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
            norm: InputNorm | None, reference: Callable[[], torch.Tensor]) -> SkinnyConfig | None:
    """The measured choice for this call's shape, measuring it in a tuning window; None
    (the reference: cuBLAS, after the ops the kernel would fuse) for more rows, an unseen
    shape outside a window, operands the kernel does not take, or where it measured best."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    plain_bias = bias is None or (bias.stride(-1) == 1 and bias.dtype == x.dtype)
    if not 0 < m <= MAX_ROWS or weight.stride(-1) != 1 or weight.dtype != x.dtype or not plain_bias:
        return None
    norm_key = None if norm is None else ("rms_norm", norm.residual is not None, norm.weight.dtype)
    key = (1 << (m - 1).bit_length(), weight.shape[0], weight.shape[1], x.dtype, bias is not None, activation,
           norm_key)
    choice = _TABLE.chosen(key)
    if choice is None:
        if not tuning_open() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None  # serving never stops to measure
        choice = _tune(key, x, weight, bias, activation, norm, reference)
    return _CONFIGS.get(choice)


def _tuned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           activation: str | None) -> torch.Tensor:
    reference = functools.partial(_reference, x, weight, bias, activation)
    config = _choice(x, weight, bias, activation, None, reference)
    return reference() if config is None else skinny_linear(x, weight, bias, config, activation)


@register_op("linear", name="triton_skinny_linear", priority=20, devices=("cuda",),
             dtypes=(torch.bfloat16, torch.float16), check=triton_missing)
def tuned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _tuned(x, weight, bias, None)


@register_op("gated_linear", name="triton_skinny_gated_linear", priority=20, devices=("cuda",),
             dtypes=(torch.bfloat16, torch.float16), check=triton_missing)
def tuned_gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str) -> torch.Tensor:
    """A gated MLP's down projection of its packed gate-up rows: act(gate) * up @ weight.T
    + bias, the activation applied while the few-row linear loads its input where that was
    measured faster than the activation's kernel, then cuBLAS."""
    if activation not in ACTIVATIONS or activation is None:
        raise ValueError(f"gated_linear: activation must be one of silu_and_mul, gelu_tanh_and_mul; "
                         f"got {activation!r}")
    return _tuned(gate_up, weight, bias, activation)


@register_op("rms_norm_linear", name="triton_skinny_rms_norm_linear", priority=20, devices=("cuda",),
             dtypes=(torch.bfloat16, torch.float16), check=triton_missing)
def tuned_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm and the linear reading it: (norm(x + residual) @ weight.T + bias,
    x + residual: the next residual, x itself without one), the norm applied while the
    few-row linear loads its input where that was measured faster than the norm's kernel,
    then the linear's own choice."""
    def reference() -> torch.Tensor:
        return _tuned(triton_rms_norm(x, norm_weight, eps, residual)[0], weight, bias, None)

    m, k = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    few = m <= MAX_ROWS  # more rows (prefill) are never the kernel's: nothing to allocate for it
    sums = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None and few else None
    norm = InputNorm(norm_weight, eps, residual, sums)
    config = _choice(x, weight, bias, None, norm, reference)
    if config is None:
        normed, summed = triton_rms_norm(x, norm_weight, eps, residual)
        return _tuned(normed, weight, bias, None), x if summed is None else summed
    out = skinny_linear(x, weight, bias, config, norm=norm)
    return out, x if sums is None else sums.view(x.shape)
