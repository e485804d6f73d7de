"""The gated delta rule (ops/linear_attention/delta_rule.py) in Triton: a fused recurrent
kernel, as flash-linear-attention's fused_recurrent_gated_delta_rule, for both phases.

One program per (sequence, value head, block of BV value columns) keeps its [Dk, BV] tile of
the float32 state in registers and walks the sequence's tokens in order: per token it loads
q, k (L2-normalised in float32, q scaled by Dk^-1/2; key head h serves value heads
h*r .. h*r+r-1), its v columns, g and beta, then S = exp(g) S; S += k (beta (v - S^T k))^T;
o = S^T q. Columns of S never mix, so the blocks of one head are independent programs. The
tile goes back to the state once, after the last token. The reference's chunked prefill
computes the same recurrence in another order (float32 rounding differs, nothing else).

Decode (one token per sequence) takes wider blocks over 4 warps, prefill (many tokens,
latency bound) narrow ones over 1 warp, as the reference kernels do: more programs, each
with a short dependency chain per token.
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
    def gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, starts_ptr, slots_ptr,
                           fresh_ptr, q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, g_s0, beta_s0, num_v_heads, group,
                           dk, dv, scale, BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
                           ROUND_BF16: tl.constexpr):
        seq = tl.program_id(0)
        hv = tl.program_id(1)
        hk = hv // group
        kk = tl.arange(0, BK)
        vv = tl.program_id(2) * BV + tl.arange(0, BV)
        k_mask, v_mask = kk < dk, vv < dv
        s_mask = k_mask[:, None] & v_mask[None, :]
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        s_ptrs = state_ptr + ((slot * num_v_heads + hv) * dk + kk[:, None]) * dv + vv[None, :]
        if VARLEN:
            start = tl.load(starts_ptr + seq).to(tl.int64)
            end = tl.load(starts_ptr + seq + 1).to(tl.int64)
            # a fresh sequence starts from zeros (a vector: the interpreter rejects scalar masks)
            s_mask_in = s_mask & ((tl.load(fresh_ptr + seq) + 0 * kk) == 0)[:, None]
        else:  # decode: row `seq` is its sequence's one token
            start = seq.to(tl.int64)
            end = start + 1
            s_mask_in = s_mask
        s = tl.load(s_ptrs, mask=s_mask_in, other=0.0)
        dt = out_ptr.dtype.element_ty
        for t in range(start, end):
            q = tl.load(q_ptr + t * q_s0 + hk * q_s1 + kk, mask=k_mask, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * k_s0 + hk * k_s1 + kk, mask=k_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + t * v_s0 + hv * v_s1 + vv, mask=v_mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + t * g_s0 + hv)
            beta = tl.load(beta_ptr + t * beta_s0 + hv)
            # eps 1e-6 under the root, as flash-linear-attention and the torch op
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            s = s * tl.exp(g)
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(out_ptr + (t * num_v_heads + hv) * dv + vv, rounding.rounded(o, ROUND_BF16, dt).to(dt),
                     mask=v_mask)
        tl.store(s_ptrs, s, mask=s_mask)

    return gated_delta_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with a unit last stride (rows and heads may be strided: q/k/v views)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _per_head(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous()


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor, seqs: int, slots: torch.Tensor, starts: torch.Tensor | None,
         fresh: torch.Tensor | None) -> torch.Tensor:
    tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (num_v_heads, dk, dv):
        raise ValueError(f"state must be contiguous float32 [slots, {num_v_heads}, {dk}, {dv}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    q, k, v, g, beta = _heads(q), _heads(k), _heads(v), _per_head(g), _per_head(beta)
    out = torch.empty((tokens, num_v_heads, dv), dtype=v.dtype, device=v.device)
    if not (tokens and seqs):
        return out
    varlen = starts is not None
    # decode: 32 columns over 4 warps; prefill: 8 over 1 warp (fla's choices)
    block_v = min(_pow2(dv), 8 if varlen else 32)
    _kernel()[(seqs, num_v_heads, -(-dv // block_v))](
        q, k, v, g, beta, state, out, starts if varlen else slots, slots, fresh if varlen else slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        num_v_heads, num_v_heads // num_k_heads, dk, dv, dk ** -0.5, BK=_pow2(dk), BV=block_v, VARLEN=varlen,
        ROUND_BF16=v.dtype == torch.bfloat16, num_warps=1 if varlen else 4)
    return out


@register_op("gated_delta_rule", name="triton_gated_delta_decode", priority=20, devices=("cuda",), dtypes=DTYPES,
             phases=("decode",), check=triton_missing)
def triton_gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence. q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv] float32;
    state: [slots, Hv, Dk, Dv] float32, updated in place for `slots` [B]. -> [B, Hv, Dv]."""
    return _run(q, k, v, g, beta, state, q.shape[0], slots, None, None)


@register_op("gated_delta_rule", name="triton_gated_delta_prefill", priority=20, devices=("cuda",), dtypes=DTYPES,
             phases=("prefill",), check=triton_missing)
def triton_gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, slots: list[int], query_lens: list[int],
                               fresh: list[bool]) -> torch.Tensor:
    """The chunks of len(query_lens) sequences one after another (shapes as decode's, T
    rows); each starts from its state (zeros where `fresh`) and leaves its final state there."""
    starts, slot_t, fresh_t = varlen_tables(slots, query_lens, fresh, v.device)
    return _run(q, k, v, g, beta, state, len(query_lens), slot_t, starts, fresh_t)
