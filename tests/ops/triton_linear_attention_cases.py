"""The Triton linear-attention kernels (causal conv1d + SiLU, the gated delta rule, Mamba-2's
selective scan) against the pure-torch ops, both phases: fresh and carried states, chunks shorter than the conv's
K - 1, several sequences of which some span several program tiles, fewer key heads than
value heads, strided q/k/v views as the layer passes them, non-consecutive slots, and
slots no row names left untouched; for the scan, one or several groups of heads and
time-step limits that clamp. Run by tests/ops/triton_cases.py, through the
interpreter on CPU or on a GPU."""
from __future__ import annotations

import torch

from tessera.ops.linear_attention.conv import causal_conv1d_decode_ref, causal_conv1d_prefill_ref
from tessera.ops.linear_attention.delta_rule import gated_delta_decode_ref, gated_delta_prefill_ref
from tessera.ops.linear_attention.mamba2 import ssm_scan_decode_ref, ssm_scan_prefill_ref
from tessera.ops.registry import OpSpec, select_op
from tessera.ops.triton.causal_conv1d import triton_causal_conv1d_decode, triton_causal_conv1d_prefill
from tessera.ops.triton.gated_delta import triton_gated_delta_decode, triton_gated_delta_prefill
from tessera.ops.triton.ssm_scan import triton_ssm_scan_decode, triton_ssm_scan_prefill

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLOTS = 6
# (slot, chunk length, fresh): a fresh chunk shorter than K - 1, carried chunks of 1 and 2
# tokens (the new conv state keeps part of the old), one over several 16-token conv tiles
# and two 64-token reference blocks; slots out of order, slot 1 unused
PREFILL = ((3, 2, True), (5, 1, False), (0, 70, False), (2, 5, True), (4, 2, False))


def _close(got: torch.Tensor, want: torch.Tensor, what: str, float32_tol: float = 1e-5) -> None:
    """float32: up to float32 rounding (`float32_tol`: the reference's chunked prefill sums
    in another order). bf16/fp16: both round to nearest where torch does, so only the
    float32 sums' last bits may move a rounding: a step of the dtype, in few elements (a
    missed or extra rounding moves many more: under the interpreter < 0.2% differ)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    step = {torch.float32: float32_tol, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=step,
                               msg=lambda m: f"{what}: max error {(got.float() - want.float()).abs().max():.3g}\n{m}")
    if want.dtype != torch.float32:
        differ = (got != want).float().mean().item()
        assert differ <= 0.01, f"{what}: {differ:.2%} of the elements differ from torch's"


def check_registration(device: str) -> None:
    for kind, stem in (("causal_conv1d", "triton_causal_conv1d"), ("gated_delta_rule", "triton_gated_delta")):
        for phase in ("decode", "prefill"):
            for dtype in DTYPES:
                chosen = select_op(OpSpec(kind, "cuda", dtype, phase=phase)).builder.name
                assert chosen == f"{stem}_{phase}", (kind, phase, dtype, chosen)


def _strided(rows: int, width: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[rows, width] as a view 8 columns into wider rows (as mixed_qkv is of the projection)."""
    return (torch.randn(rows, width + 8, generator=g) * 2).to(dtype)[:, 8:]


def check_causal_conv1d(device: str) -> None:
    g = torch.Generator().manual_seed(21)
    for dtype in DTYPES:
        for channels, width, with_bias in ((40, 4, False), (300, 4, True), (33, 3, True), (16, 2, False)):
            weight = (torch.randn(channels, width, generator=g) / width ** 0.5).to(dtype)
            bias = torch.randn(channels, generator=g).to(dtype) if with_bias else None
            dev_bias = None if bias is None else bias.to(device)
            state = torch.randn(SLOTS, channels, width - 1, generator=g).to(dtype)
            what = f"conv {dtype} C={channels} K={width} bias={with_bias}"

            slots = torch.tensor([4, 0, 2])  # decode: slots 1, 3, 5 untouched
            x = _strided(3, channels, dtype, g)
            want_state = state.clone()
            want = causal_conv1d_decode_ref(x, weight, bias, want_state, slots)
            got_state = state.clone().to(device)  # .to alone aliases on CPU
            got = triton_causal_conv1d_decode(x.to(device), weight.to(device), dev_bias, got_state, slots.to(device))
            _close(got, want, f"{what} decode")
            assert torch.equal(got_state.cpu(), want_state), f"{what} decode state"
            assert torch.equal(got_state.cpu()[[1, 3, 5]], state[[1, 3, 5]]), f"{what} decode untouched slots"

            p_slots, lens, fresh = (list(c) for c in zip(*PREFILL))
            x = _strided(sum(lens), channels, dtype, g)
            want_state = state.clone()
            want = causal_conv1d_prefill_ref(x, weight, bias, want_state, p_slots, lens, fresh)
            got_state = state.clone().to(device)  # .to alone aliases on CPU
            got = triton_causal_conv1d_prefill(x.to(device), weight.to(device), dev_bias, got_state, p_slots, lens,
                                               fresh)
            _close(got, want, f"{what} prefill")
            assert torch.equal(got_state.cpu(), want_state), f"{what} prefill state"
            assert torch.equal(got_state.cpu()[1], state[1]), f"{what} prefill untouched slot"


def _qkv(tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, g: torch.Generator):
    """q, k [T, Hk, Dk], v [T, Hv, Dv] as the layer's split of the conv output: views of one
    [T, 2 Hk Dk + Hv Dv] row (strided rows, not contiguous), plus g (log decay <= 0) and
    beta in (0, 1), float32 [T, Hv]."""
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=g).to(dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g_log = -torch.nn.functional.softplus(torch.randn(tokens, hv, generator=g)) * 0.3
    beta = torch.sigmoid(torch.randn(tokens, hv, generator=g))
    return q.reshape(tokens, hk, dk), k.reshape(tokens, hk, dk), v.reshape(tokens, hv, dv), g_log, beta


def check_gated_delta(device: str) -> None:
    g = torch.Generator().manual_seed(22)
    on = (lambda t: t.to(device))
    # (Hk, Hv, Dk, Dv): two value heads per key head; one each with ragged (non power of
    # two) widths; four per key head at 64 x 40 (several column blocks, both phases).
    # fp16 once: it rounds as bf16 does (interpreter time: ~4 s per prefill)
    for hk, hv, dk, dv in ((2, 4, 16, 16), (3, 3, 24, 20), (1, 4, 64, 40)):
        for dtype in DTYPES if dk == 16 else DTYPES[:2]:
            what = f"gated delta {dtype} Hk={hk} Hv={hv} Dk={dk} Dv={dv}"
            state = torch.randn(SLOTS, hv, dk, dv, generator=g) * 0.5

            slots = torch.tensor([4, 0, 2])
            q, k, v, g_log, beta = _qkv(3, hk, hv, dk, dv, dtype, g)
            assert not q.is_contiguous()
            want_state = state.clone()
            want = gated_delta_decode_ref(q, k, v, g_log, beta, want_state, slots)
            got_state = on(state.clone())
            got = triton_gated_delta_decode(on(q), on(k), on(v), on(g_log), on(beta), got_state, on(slots))
            _close(got, want, f"{what} decode")
            _close(got_state, want_state, f"{what} decode state")
            assert torch.equal(got_state.cpu()[[1, 3, 5]], state[[1, 3, 5]]), f"{what} decode untouched slots"

            p_slots, lens, fresh = (list(c) for c in zip(*PREFILL))
            q, k, v, g_log, beta = _qkv(sum(lens), hk, hv, dk, dv, dtype, g)
            want_state = state.clone()
            want = gated_delta_prefill_ref(q, k, v, g_log, beta, want_state, p_slots, lens, fresh)
            got_state = on(state.clone())
            got = triton_gated_delta_prefill(on(q), on(k), on(v), on(g_log), on(beta), got_state, p_slots, lens,
                                             fresh)
            _close(got, want, f"{what} prefill", float32_tol=2e-4)
            _close(got_state, want_state, f"{what} prefill state", float32_tol=2e-4)
            assert torch.equal(got_state.cpu()[1], state[1]), f"{what} prefill untouched slot"


def check_layer_split(device: str) -> None:
    """The two ops chained as GatedDeltaRule.forward chains them (the conv's output split
    into q/k/v views), over two steps in bf16: two fresh prefills, then a decode continuing
    one, a prefill continuing the other and a new fresh one. The conv state is exact; the
    rest within bf16 steps (a conv output a step off moves everything after it)."""
    g = torch.Generator().manual_seed(23)
    hk, hv, dk, dv, width, dtype = 2, 4, 16, 8, 4, torch.bfloat16
    channels = 2 * hk * dk + hv * dv
    weight = (torch.randn(channels, width, generator=g) / 2).to(dtype)
    conv = {"want": torch.zeros(SLOTS, channels, width - 1, dtype=dtype)}
    rec = {"want": torch.zeros(SLOTS, hv, dk, dv)}
    conv["got"], rec["got"] = conv["want"].clone().to(device), rec["want"].clone().to(device)
    ops = {"want": (causal_conv1d_decode_ref, causal_conv1d_prefill_ref, gated_delta_decode_ref,
                    gated_delta_prefill_ref),
           "got": (triton_causal_conv1d_decode, triton_causal_conv1d_prefill, triton_gated_delta_decode,
                   triton_gated_delta_prefill)}

    def split(x: torch.Tensor):
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        return q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv)

    # (decode slots, prefill slots, lens, fresh)
    for step, (dec, slots, lens, fresh) in enumerate((([], [1, 4], [6, 3], [True, True]),
                                                      ([4], [1, 0], [9, 2], [False, True]))):
        nd = len(dec)
        x = torch.randn(nd + sum(lens), channels, generator=g).to(dtype)
        g_log = -torch.rand(nd + sum(lens), hv, generator=g)
        beta = torch.rand(nd + sum(lens), hv, generator=g)
        outs = {}
        for side, put in (("want", lambda t: t), ("got", lambda t: t.to(device))):
            conv_decode, conv_prefill, rule_decode, rule_prefill = ops[side]
            parts = []
            if nd:
                d_slots = put(torch.tensor(dec))
                mixed = conv_decode(put(x[:nd]), put(weight), None, conv[side], d_slots)
                parts.append(rule_decode(*split(mixed), put(g_log[:nd]), put(beta[:nd]), rec[side], d_slots))
            mixed = conv_prefill(put(x[nd:]), put(weight), None, conv[side], slots, lens, fresh)
            parts.append(rule_prefill(*split(mixed), put(g_log[nd:]), put(beta[nd:]), rec[side], slots, lens, fresh))
            outs[side] = torch.cat([p.cpu() for p in parts])
        _close(outs["got"], outs["want"], f"layer step {step}")
        assert torch.equal(conv["got"].cpu(), conv["want"]), f"layer step {step} conv state"
        _close(rec["got"], rec["want"], f"layer step {step} state", float32_tol=2 ** -7)


def _mamba_inputs(tokens: int, heads: int, groups: int, head_dim: int, size: int, dtype: torch.dtype,
                  g: torch.Generator):
    """x [T, H, P], B, C [T, G, N] as Mamba2Scan splits the conv output (views of its rows,
    not contiguous) and dt [T, H] as a column slice of the projection's rows."""
    conv = torch.randn(tokens, heads * head_dim + 2 * groups * size, generator=g).to(dtype)
    x, b, c = conv.split([heads * head_dim, groups * size, groups * size], dim=-1)
    dt = (torch.randn(tokens, heads + 5, generator=g) * 2).to(dtype)[:, 5:]
    dt[0, 0], dt[-1, -1] = 25.0, -30.0  # softplus's linear branch (> 20) and its far tail
    return (x.reshape(tokens, heads, head_dim), dt, b.reshape(tokens, groups, size),
            c.reshape(tokens, groups, size))


def check_ssm_scan(device: str) -> None:
    """Mamba-2's scan, both phases: one group and several, ragged P and N (masked rows and
    columns), P over several decode blocks, time-step limits that clamp on both sides."""
    for phase in ("decode", "prefill"):
        for dtype in DTYPES:
            chosen = select_op(OpSpec("ssm_scan", "cuda", dtype, phase=phase)).builder.name
            assert chosen == f"triton_ssm_scan_{phase}", (phase, dtype, chosen)
    g = torch.Generator().manual_seed(24)
    on = (lambda t: t.to(device))
    # (H, G, P, N, limits), small (interpreter time: ~2 s per prefill); fp16 once: it
    # rounds as bf16 does. P = 24: two decode blocks (16 rows), three prefill ones (8)
    for heads, groups, head_dim, size, limits in ((2, 1, 16, 16, (0.0, float("inf"))),
                                                  (4, 2, 12, 24, (0.2, 1.5)), (2, 2, 24, 8, (0.1, 1.0))):
        for dtype in DTYPES if size == 16 else DTYPES[:2]:
            what = f"ssm scan {dtype} H={heads} G={groups} P={head_dim} N={size} limits={limits}"
            state = torch.randn(SLOTS, heads, head_dim, size, generator=g) * 0.5
            dt_bias = (torch.randn(heads, generator=g) * 0.5).to(dtype)
            A = -torch.rand(heads, generator=g) * 2 - 0.1
            D = torch.randn(heads, generator=g).to(dtype)

            slots = torch.tensor([4, 0, 2])
            x, dt, b, c = _mamba_inputs(3, heads, groups, head_dim, size, dtype, g)
            assert not (x.is_contiguous() or dt.is_contiguous() or b.is_contiguous())
            want_state = state.clone()
            want = ssm_scan_decode_ref(x, dt, dt_bias, A, b, c, D, limits, want_state, slots)
            got_state = on(state.clone())
            got = triton_ssm_scan_decode(on(x), on(dt), on(dt_bias), on(A), on(b), on(c), on(D), limits, got_state,
                                         on(slots))
            _close(got, want, f"{what} decode")
            _close(got_state, want_state, f"{what} decode state")
            assert torch.equal(got_state.cpu()[[1, 3, 5]], state[[1, 3, 5]]), f"{what} decode untouched slots"

            p_slots, lens, fresh = (list(col) for col in zip(*PREFILL))
            x, dt, b, c = _mamba_inputs(sum(lens), heads, groups, head_dim, size, dtype, g)
            if limits[1] < float("inf"):  # the limits do clamp, below and above
                steps = torch.nn.functional.softplus(dt.float() + dt_bias.float())
                assert (steps < limits[0]).any() and (steps > limits[1]).any(), what
            want_state = state.clone()
            want = ssm_scan_prefill_ref(x, dt, dt_bias, A, b, c, D, limits, want_state, p_slots, lens, fresh)
            got_state = on(state.clone())
            got = triton_ssm_scan_prefill(on(x), on(dt), on(dt_bias), on(A), on(b), on(c), on(D), limits,
                                          got_state, p_slots, lens, fresh)
            # the reference's SSD blocks sum in another order
            _close(got, want, f"{what} prefill", float32_tol=2e-4)
            _close(got_state, want_state, f"{what} prefill state", float32_tol=2e-4)
            assert torch.equal(got_state.cpu()[1], state[1]), f"{what} prefill untouched slot"


LINEAR_ATTENTION_CHECKS = (check_registration, check_causal_conv1d, check_gated_delta, check_layer_split,
                           check_ssm_scan)
