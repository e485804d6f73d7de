"""The causal depthwise conv1d + SiLU of linear attention (ops/linear_attention/conv.py) in
Triton, with the same arguments and roundings: the sum in float32, rounded to the model
dtype, SiLU, rounded again (both on the bits for bf16: rounding.py).

Decode: one program per (sequence, block of channels) reads its window (the state's K - 1
inputs and the new token), writes the shifted state back and the output row.
Prefill: one program per (sequence, block of tokens, block of channels) reads each input
once per tap: from the chunk, and in a chunk's first tile from the state (zeros for a fresh
sequence). A second launch then writes each sequence's new state: a program writing
it in the first launch could run before another program of its sequence read the old one.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DECODE_CHANNELS = 256  # channels per decode program
PREFILL_TOKENS = 16    # tokens x channels per prefill program (32 x 128: 200+ registers)
PREFILL_CHANNELS = 128


@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    global rounding  # a module global: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import rounding

    @triton.jit
    def conv_decode_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, out_ptr, channels, x_stride,
                           w_stride, state_s0, state_s1, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        j = tl.arange(0, BLOCK_K)  # taps: 0 .. WIDTH - 2 from the state, WIDTH - 1 the new token
        c_mask = c < channels
        slot = tl.load(slots_ptr + row).to(tl.int64)
        state = state_ptr + slot * state_s0 + c[:, None] * state_s1
        x = tl.load(x_ptr + row * x_stride + c, mask=c_mask, other=0.0).to(state_ptr.dtype.element_ty)
        old = tl.load(state + j[None, :], mask=c_mask[:, None] & (j[None, :] < WIDTH - 1), other=0.0)
        window = tl.where(j[None, :] == WIDTH - 1, x[:, None], old)
        # the new state is the window shifted by one
        shifted = tl.load(state + j[None, :] + 1, mask=c_mask[:, None] & (j[None, :] < WIDTH - 2), other=0.0)
        shifted = tl.where(j[None, :] == WIDTH - 2, x[:, None], shifted)
        w = tl.load(w_ptr + c[:, None] * w_stride + j[None, :], mask=c_mask[:, None] & (j[None, :] < WIDTH),
                    other=0.0)
        acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every thread's state loads first: another may hold taps of the same channel
        tl.store(state + j[None, :], shifted, mask=c_mask[:, None] & (j[None, :] < WIDTH - 1))
        # torch: the sum to the model dtype, then F.silu on it (float math, rounded once)
        dt = out_ptr.dtype.element_ty
        r = rounding.rounded(acc, ROUND_BF16, dt)
        tl.store(out_ptr + row * channels + c, rounding.rounded(r / (1.0 + tl.exp(-r)), ROUND_BF16, dt).to(dt),
                 mask=c_mask)

    @triton.jit
    def conv_prefill_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, starts_ptr, slots_ptr, fresh_ptr, out_ptr,
                            channels, x_stride, w_stride, state_s0, state_s1, WIDTH: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ROUND_BF16: tl.constexpr):
        seq = tl.program_id(0)
        start = tl.load(starts_ptr + seq).to(tl.int64)
        n = tl.load(starts_ptr + seq + 1).to(tl.int64) - start
        p = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # positions in the chunk
        if tl.program_id(1) * BLOCK_T < n:  # the grid covers the longest chunk
            c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
            c_mask = c < channels
            valid = (p < n)[:, None] & c_mask[None, :]
            rows = x_ptr + (start + p)[:, None] * x_stride + c[None, :]
            acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for tap in tl.static_range(WIDTH):
                back = WIDTH - 1 - tap  # this tap reads the input `back` positions earlier
                xv = tl.load(rows - back * x_stride, mask=valid & (p >= back)[:, None], other=0.0)
                w = tl.load(w_ptr + c * w_stride + tap, mask=c_mask, other=0.0).to(tl.float32)
                acc += xv.to(state_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
            # inputs before the chunk: the first tile only, from the state unless fresh (zeros);
            # apart from the loop above, whose registers this would add to (spills in float32)
            if (tl.program_id(1) == 0) & (tl.load(fresh_ptr + seq) == 0):
                state = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * state_s0 + c[None, :] * state_s1
                for tap in tl.static_range(WIDTH - 1):
                    i = p + (tap - (WIDTH - 1))  # < 0: state entry WIDTH - 1 + i
                    sv = tl.load(state + (i + WIDTH - 1)[:, None], mask=valid & (i < 0)[:, None], other=0.0)
                    w = tl.load(w_ptr + c * w_stride + tap, mask=c_mask, other=0.0).to(tl.float32)
                    acc += sv.to(tl.float32) * w[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
            dt = out_ptr.dtype.element_ty
            r = rounding.rounded(acc, ROUND_BF16, dt)  # as decode's
            tl.store(out_ptr + (start + p)[:, None] * channels + c[None, :],
                     rounding.rounded(r / (1.0 + tl.exp(-r)), ROUND_BF16, dt).to(dt), mask=valid)

    @triton.jit
    def conv_state_kernel(x_ptr, state_ptr, starts_ptr, slots_ptr, fresh_ptr, channels, x_stride,
                          state_s0, state_s1, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        # the last WIDTH - 1 of (state or zeros, chunk): entry j is input n + j - (WIDTH - 1)
        seq = tl.program_id(0)
        start = tl.load(starts_ptr + seq).to(tl.int64)
        n = tl.load(starts_ptr + seq + 1).to(tl.int64) - start
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        j = tl.arange(0, BLOCK_K)
        mask = (c < channels)[:, None] & (j < WIDTH - 1)[None, :]
        keep = (tl.load(fresh_ptr + seq) + 0 * j) == 0  # a vector: the interpreter rejects scalar masks
        state = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * state_s0 + c[:, None] * state_s1
        i = n + j - (WIDTH - 1)
        xv = tl.load(x_ptr + (start + i)[None, :] * x_stride + c[:, None], mask=mask & (i >= 0)[None, :], other=0.0)
        sv = tl.load(state + (n + j)[None, :], mask=mask & ((i < 0) & keep)[None, :], other=0.0)
        new = tl.where((i >= 0)[None, :], xv.to(state_ptr.dtype.element_ty), sv)
        tl.debug_barrier()  # every thread's reads of the old state before any write
        tl.store(state + j[None, :], new, mask=mask)

    return conv_decode_kernel, conv_prefill_kernel, conv_state_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_state(conv_state: torch.Tensor, weight: torch.Tensor) -> None:
    if conv_state.stride(-1) != 1 or conv_state.shape[-1] != weight.shape[1] - 1:
        raise ValueError(f"conv_state must be [slots, C, K - 1] with a unit last stride, got {tuple(conv_state.shape)} "
                         f"strides {conv_state.stride()} for weight {tuple(weight.shape)}")


def varlen_tables(slots: list[int], query_lens: list[int], fresh: list[bool],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill's host lists as device tensors, in one copy: chunk starts [N + 1],
    slots [N], fresh flags [N] (int64 views of one buffer, each 16-byte aligned: Triton
    specialises pointers on that, so an unaligned view would compile a second variant)."""
    n = len(slots)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    starts += [0] * ((n + 1) % 2)
    slot_list = list(slots) + [0] * (n % 2)
    packed = torch.tensor(starts + slot_list + [int(f) for f in fresh], dtype=torch.int64).to(device)
    at = len(starts) + len(slot_list)
    return packed[:n + 1], packed[len(starts):len(starts) + n], packed[at:at + n]


@register_op("causal_conv1d", name="triton_causal_conv1d_decode", priority=20, devices=("cuda",), dtypes=DTYPES,
             phases=("decode",), check=triton_missing)
def triton_causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [B, C]; weight: [C, K]; conv_state: [slots, C, K - 1], updated in place for `slots`."""
    _check_state(conv_state, weight)
    x, weight = _rows(x), _rows(weight)
    rows, channels = x.shape
    out = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    if rows and channels:
        width = weight.shape[1]
        _kernels()[0][(rows, -(-channels // DECODE_CHANNELS))](
            x, weight, weight if bias is None else bias, conv_state, slots, out, channels, x.stride(0),
            weight.stride(0), conv_state.stride(0), conv_state.stride(1), WIDTH=width, BLOCK_K=_pow2(width),
            BLOCK_C=DECODE_CHANNELS, HAS_BIAS=bias is not None, ROUND_BF16=x.dtype == torch.bfloat16)
    return out


@register_op("causal_conv1d", name="triton_causal_conv1d_prefill", priority=20, devices=("cuda",), dtypes=DTYPES,
             phases=("prefill",), check=triton_missing)
def triton_causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 conv_state: torch.Tensor, slots: list[int], query_lens: list[int],
                                 fresh: list[bool]) -> torch.Tensor:
    """x: [T, C], the chunks of len(query_lens) sequences one after another; each sequence's
    state is read unless `fresh` and replaced by its last K - 1 inputs."""
    _check_state(conv_state, weight)
    x, weight = _rows(x), _rows(weight)
    tokens, channels = x.shape
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    if not (query_lens and channels):
        return out
    starts, slot_t, fresh_t = varlen_tables(slots, query_lens, fresh, x.device)
    width, seqs = weight.shape[1], len(query_lens)
    _, prefill_kernel, state_kernel = _kernels()
    bias_arg = weight if bias is None else bias
    if max(query_lens):
        grid = (seqs, -(-max(query_lens) // PREFILL_TOKENS), -(-channels // PREFILL_CHANNELS))
        prefill_kernel[grid](x, weight, bias_arg, conv_state, starts, slot_t, fresh_t, out, channels, x.stride(0),
                             weight.stride(0), conv_state.stride(0), conv_state.stride(1), WIDTH=width,
                             BLOCK_T=PREFILL_TOKENS, BLOCK_C=PREFILL_CHANNELS, HAS_BIAS=bias is not None,
                             ROUND_BF16=x.dtype == torch.bfloat16)
    if width > 1:  # after every read of the old states (stream order)
        state_kernel[(seqs, -(-channels // DECODE_CHANNELS))](
            x, conv_state, starts, slot_t, fresh_t, channels, x.stride(0), conv_state.stride(0),
            conv_state.stride(1), WIDTH=width, BLOCK_K=_pow2(width - 1), BLOCK_C=DECODE_CHANNELS)
    return out
