"""Mamba-2's selective scan (ops/linear_attention/mamba2.py) in Triton: a fused recurrent
kernel, as mamba_ssm's selective_state_update, for both phases.

One program per (sequence, head, block of BP rows of the head's P) keeps its [BP, N] tile of
the float32 state in registers and walks the sequence's tokens in order: per token it loads
its x rows, dt (softplus(dt + dt_bias) clamped to the limits, in float32), and the B, C of
the head's group (head h reads group h // (H / G)), then S = exp(dt A) S + (dt x) B^T;
y = S C + D x. Rows of S never mix, so the blocks of one head are independent programs. The
tile goes back to the state once, after the last token. The reference's chunked (SSD)
prefill computes the same recurrence in another order (float32 rounding differs, nothing
else).

Decode (one token per sequence) takes wider blocks over 4 warps, prefill (many tokens,
latency bound) narrow ones over 1 warp, as gated_delta.py does: more programs, each with a
short dependency chain per token.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.causal_conv1d import varlen_tables

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    global rounding  # a module global: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import rounding

    @triton.jit
    def ssm_scan_kernel(x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, starts_ptr,
                        slots_ptr, fresh_ptr, x_s0, x_s1, dt_s0, b_s0, b_s1, c_s0, c_s1, num_heads, group,
                        head_dim, state_size, lo, hi, BP: tl.constexpr, BN: tl.constexpr, VARLEN: tl.constexpr,
                        ROUND_BF16: tl.constexpr):
        seq = tl.program_id(0)
        h = tl.program_id(1)
        g = h // group
        pp = tl.program_id(2) * BP + tl.arange(0, BP)
        nn = tl.arange(0, BN)
        p_mask, n_mask = pp < head_dim, nn < state_size
        s_mask = p_mask[:, None] & n_mask[None, :]
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        s_ptrs = state_ptr + ((slot * num_heads + h) * head_dim + pp[:, None]) * state_size + nn[None, :]
        if VARLEN:
            start = tl.load(starts_ptr + seq).to(tl.int64)
            end = tl.load(starts_ptr + seq + 1).to(tl.int64)
            # a fresh sequence starts from zeros (a vector: the interpreter rejects scalar masks)
            s_mask_in = s_mask & ((tl.load(fresh_ptr + seq) + 0 * pp) == 0)[:, None]
        else:  # decode: row `seq` is its sequence's one token
            start = seq.to(tl.int64)
            end = start + 1
            s_mask_in = s_mask
        s = tl.load(s_ptrs, mask=s_mask_in, other=0.0)
        a = tl.load(a_ptr + h).to(tl.float32)
        d = tl.load(d_ptr + h).to(tl.float32)
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        for t in range(start, end):
            x = tl.load(x_ptr + t * x_s0 + h * x_s1 + pp, mask=p_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + t * b_s0 + g * b_s1 + nn, mask=n_mask, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + t * c_s0 + g * c_s1 + nn, mask=n_mask, other=0.0).to(tl.float32)
            v = tl.load(dt_ptr + t * dt_s0 + h).to(tl.float32) + bias
            # softplus as torch's (threshold 20), log1p(u) = u log(w) / (w - 1) with w = 1 + u
            # (Goldberg: exact where w rounds, as tl has no log1p), then the clamp; the
            # branches not taken kept finite (no inf / 0 / 0 for the interpreter to warn of)
            u = tl.exp(tl.minimum(v, 20.0))
            w = 1.0 + u
            wm1 = tl.where(w == 1.0, 1.0, w - 1.0)
            step = tl.where(v > 20.0, v, tl.where(w == 1.0, u, u * tl.log(w) / wm1))
            step = tl.minimum(tl.maximum(step, lo), hi)
            s = s * tl.exp(step * a) + (step * x)[:, None] * b[None, :]
            y = tl.sum(s * c[None, :], axis=1) + d * x
            tl.store(out_ptr + (t * num_heads + h) * head_dim + pp, rounding.rounded(y, ROUND_BF16, dt).to(dt),
                     mask=p_mask)
        tl.store(s_ptrs, s, mask=s_mask)

    return ssm_scan_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """A unit last stride (rows and heads/groups may be strided: views of the conv output)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _run(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         C: torch.Tensor, D: torch.Tensor, limits: tuple[float, float], state: torch.Tensor, seqs: int,
         slots: torch.Tensor, starts: torch.Tensor | None, fresh: torch.Tensor | None) -> torch.Tensor:
    tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    if num_heads % num_groups:
        raise ValueError(f"heads ({num_heads}) must be a multiple of groups ({num_groups})")
    if tuple(C.shape) != tuple(B.shape) or tuple(dt.shape) != (tokens, num_heads):
        raise ValueError(f"B {tuple(B.shape)}, C {tuple(C.shape)}, dt {tuple(dt.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if (state.dtype != torch.float32 or not state.is_contiguous()
            or tuple(state.shape[1:]) != (num_heads, head_dim, state_size)):
        raise ValueError(f"state must be contiguous float32 [slots, {num_heads}, {head_dim}, {state_size}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    x, dt, B, C = _unit_last(x), _unit_last(dt), _unit_last(B), _unit_last(C)
    dt_bias, A, D = dt_bias.contiguous(), A.contiguous(), D.contiguous()
    out = torch.empty((tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if not (tokens and seqs):
        return out
    varlen = starts is not None
    # decode: 16 rows over 4 warps; prefill: 8 over 1 warp (as gated_delta.py's blocks)
    block_p = min(_pow2(head_dim), 8 if varlen else 16)
    _kernel()[(seqs, num_heads, -(-head_dim // block_p))](
        x, dt, dt_bias, A, B, C, D, state, out, starts if varlen else slots, slots, fresh if varlen else slots,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1), num_heads,
        num_heads // num_groups, head_dim, state_size, float(limits[0]), float(limits[1]), BP=block_p,
        BN=_pow2(state_size), VARLEN=varlen, ROUND_BF16=x.dtype == torch.bfloat16, num_warps=1 if varlen else 4)
    return out


@register_op("ssm_scan", name="triton_ssm_scan_decode", priority=20, devices=("cuda",), dtypes=DTYPES,
             phases=("decode",), check=triton_missing)
def triton_ssm_scan_decode(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, limits: tuple[float, float],
                           state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence. x: [B, H, P]; dt: [B, H] (before softplus); dt_bias, A, D:
    [H]; B, C: [B, G, N]; state: [slots, H, P, N] float32, updated in place for `slots`.
    -> [B, H, P] in x's dtype."""
    return _run(x, dt, dt_bias, A, B, C, D, limits, state, x.shape[0], slots, None, None)


@register_op("ssm_scan", name="triton_ssm_scan_prefill", priority=20, devices=("cuda",), dtypes=DTYPES,
             phases=("prefill",), check=triton_missing)
def triton_ssm_scan_prefill(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, limits: tuple[float, float],
                            state: torch.Tensor, slots: list[int], query_lens: list[int],
                            fresh: list[bool]) -> torch.Tensor:
    """The chunks of len(query_lens) sequences one after another (shapes as decode's, T
    rows); each starts from its state (zeros where `fresh`) and leaves its final state there."""
    starts, slot_t, fresh_t = varlen_tables(slots, query_lens, fresh, x.device)
    return _run(x, dt, dt_bias, A, B, C, D, limits, state, len(query_lens), slot_t, starts, fresh_t)
