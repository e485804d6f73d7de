"""The few-row linear (tessera/ops/triton/skinny_linear.py) against the pure-torch ops: the
plain product, the gated activation and the input RMSNorm applied while loading, and the
tuned builders' choices. Run by tests/ops/triton_cases.py, through the interpreter on CPU
or on a GPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.norm import rms_norm_ref
from tessera.ops.triton.activation import triton_gelu_tanh_and_mul, triton_silu_and_mul
from tessera.ops.triton.rms_norm import triton_rms_norm
from tessera.ops.triton.skinny_linear import InputNorm, SkinnyConfig, skinny_linear

from tests.ops.triton_attention_cases import counters_are_zero


def check_skinny_linear(device: str) -> None:
    """The few-row linear against float32 torch: rows 1 to 16, ragged N and K, unsplit and
    split over K (uneven splits), bias, a strided input, several tiles. float16 (and bf16 on
    a GPU: the interpreter's tl.dot misreads bf16 operands, its float16 is exact)."""
    g = torch.Generator().manual_seed(7)
    configs = (SkinnyConfig(32, 32, 1, 4, 2), SkinnyConfig(64, 64, 3, 4, 2), SkinnyConfig(32, 64, 2),
               SkinnyConfig(16, 16, 5, 2, 1))
    dtypes = (torch.float16,) if device == "cpu" else (torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for m, n, k in ((1, 64, 256), (3, 40, 48), (16, 96, 200), (7, 128, 512)):
            wide = torch.randn(m, k + 8, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            for x in (wide[:, :k].contiguous(), wide[:, 8:]):  # rows k + 8 apart in the second
                for bias in (None, b):
                    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
                    for config in configs:
                        got = skinny_linear(x.to(device), w.to(device), None if bias is None else bias.to(device),
                                            config)
                        assert got.shape == (m, n) and got.dtype == dtype
                        assert counters_are_zero(device)  # the split-K tiles' counters
                        torch.testing.assert_close(got.cpu().float(), want, rtol=2 ** -7, atol=2e-3,
                                                   msg=lambda e: f"{dtype} {m}x{n}x{k} {config} bias "
                                                                 f"{bias is not None}: {e}")
    # a gated MLP's down projection: the activation applied while loading gives what the
    # activation's kernel, then the linear give, bit for bit (the same roundings)
    for activation, act_kernel in (("silu_and_mul", triton_silu_and_mul), ("gelu_tanh_and_mul", triton_gelu_tanh_and_mul)):
        for m, n, k in ((1, 64, 256), (5, 40, 200)):
            wide = (torch.randn(m, 2 * k + 8, generator=g) * 2).to(torch.float16)
            gate_up = wide[:, 8:].to(device)  # strided, as a packed gate-up view
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.float16).to(device)
            for config in configs:
                got = skinny_linear(gate_up, w, None, config, activation)
                want = skinny_linear(act_kernel(gate_up), w, None, config)
                assert torch.equal(got, want), (activation, m, n, k, config)
                assert counters_are_zero(device)
    try:
        skinny_linear(gate_up[:, :k], w, None, configs[0], "silu_and_mul")
    except ValueError:
        pass
    else:
        raise AssertionError("a gated input as wide as the weight accepted")
    x = torch.randn(2, 3, 32, generator=g).to(torch.float16)  # leading dims kept
    w = torch.randn(24, 32, generator=g).to(torch.float16)
    got = skinny_linear(x.to(device), w.to(device), None, configs[0])
    torch.testing.assert_close(got.cpu().float(), F.linear(x.float(), w.float()), rtol=2 ** -7, atol=2e-3)
    assert skinny_linear(x[:0].to(device), w.to(device), None, configs[0]).shape == (0, 3, 24)
    try:
        skinny_linear(torch.zeros(17, 32, dtype=torch.float16, device=device), w.to(device), None, configs[0])
    except ValueError:
        pass
    else:
        raise AssertionError("17 rows accepted")


def check_norm_linear(device: str) -> None:
    """The few-row linear normalising its input rows as it loads them (a layer's input
    RMSNorm: skinny_linear's InputNorm) against the norm op, then float32 torch: with and
    without a residual (whose sum, the next residual, is the norm op's bit for bit), a norm
    weight in the model dtype and in float32 (Gemma's), rows 1 to 16 (strided), ragged N and
    K, split over K; float16 (the interpreter's bf16 dots are not exact)."""
    g = torch.Generator().manual_seed(11)
    configs = (SkinnyConfig(32, 32, 1, 4, 2), SkinnyConfig(32, 64, 2), SkinnyConfig(16, 16, 5, 2, 1))
    dtype = torch.float16
    for m, n, k in ((1, 64, 256), (3, 40, 200), (16, 96, 48)):
        x = (torch.randn(m, k + 8, generator=g) * 3).to(dtype)[:, 8:]
        res = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        for norm_w in ((1 + 0.2 * torch.randn(k, generator=g)).to(dtype), 0.2 * torch.randn(k, generator=g)):
            for residual in (None, res):
                normed, summed = rms_norm_ref(x, norm_w, 1e-6, residual)
                want = F.linear(normed.float(), w.float())
                for config in configs:
                    sums = None if residual is None else torch.full((m, k), 7.0, dtype=dtype, device=device)
                    norm = InputNorm(norm_w.to(device), 1e-6, None if residual is None else residual.to(device), sums)
                    got = skinny_linear(x.to(device), w.to(device), None, config, norm=norm)
                    assert counters_are_zero(device)
                    label = f"{m}x{n}x{k} {config} weight {norm_w.dtype} residual {residual is not None}"
                    torch.testing.assert_close(got.cpu().float(), want, rtol=2 ** -7, atol=2e-3,
                                               msg=lambda e: f"{label}: {e}")
                    if residual is not None:
                        assert torch.equal(sums.cpu(), summed), label
    # rows of small integers, whose squares sum exactly in any order: the same statistics as
    # the norm's kernel, so normalising while loading is that kernel, then the linear, bit for bit
    for m, n, k in ((1, 64, 256), (5, 40, 200)):
        x = torch.randint(-8, 9, (m, k), generator=g).to(dtype).to(device)
        res = torch.randint(-8, 9, (m, k), generator=g).to(dtype).to(device)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
        for norm_w in ((1 + 0.2 * torch.randn(k, generator=g)).to(dtype), 0.2 * torch.randn(k, generator=g)):
            norm_w = norm_w.to(device)
            for residual in (None, res):
                normed, _ = triton_rms_norm(x, norm_w, 1e-6, residual)
                for config in configs:
                    sums = None if residual is None else torch.empty(m, k, dtype=dtype, device=device)
                    got = skinny_linear(x, w, None, config, norm=InputNorm(norm_w, 1e-6, residual, sums))
                    assert torch.equal(got, skinny_linear(normed, w, None, config)), (m, n, k, config, norm_w.dtype)
    for bad in (dict(activation="silu_and_mul"), dict(norm_w=torch.ones(k - 1, dtype=dtype)),
                dict(sums=torch.empty(m, k, dtype=torch.float32))):
        norm = InputNorm(bad.get("norm_w", norm_w).to(device), 1e-6, res.to(device),
                         bad.get("sums", torch.empty(m, k, dtype=dtype)).to(device))
        wide = torch.cat([x, x], dim=1) if "activation" in bad else x
        try:
            skinny_linear(wide.to(device), w.to(device), None, configs[0], bad.get("activation"), norm)
        except ValueError:
            pass
        else:
            raise AssertionError(f"accepted {list(bad)}")


def check_tuned_norm_linear(device: str) -> None:
    """The rms_norm_linear builder: outside a tuning window the norm's kernel, then the
    linear; in one, the candidates timed (a stand-in timer favouring one) under a key of
    their own and the fastest kept; the next residual is x + residual (x itself without)."""
    from tessera.ops import kernel_tuning as tuning
    from tessera.ops.triton import skinny_linear as module

    g = torch.Generator().manual_seed(13)
    x = (torch.randn(5, 600, generator=g) * 2).to(torch.float16).to(device)
    res = torch.randn(5, 600, generator=g).to(torch.float16).to(device)
    norm_w = (1 + 0.2 * torch.randn(600, generator=g)).to(torch.float16).to(device)
    w = (torch.randn(80, 600, generator=g) / 25).to(torch.float16).to(device)
    module._TABLE.clear()
    measured = len(tuning.records())
    out, summed = module.tuned_rms_norm_linear(x, res, norm_w, 1e-6, w, None)
    normed, want_sum = triton_rms_norm(x, norm_w, 1e-6, res)
    assert torch.equal(out, F.linear(normed, w)) and torch.equal(summed, want_sum)
    assert len(tuning.records()) == measured
    favourite = module.candidate_configs(80, 600, 4)[-1]

    def timer(runs: dict) -> dict[str, float]:  # kernel candidates: partials of (x, weight, bias, config, ...)
        return {name: 1e-5 if getattr(run, "args", ())[3:4] == (favourite,) else 2e-5 for name, run in runs.items()}

    original = module._timer, module._num_sms
    module._timer, module._num_sms = (lambda device: timer), (lambda device: 4)
    try:
        with tuning.kernel_tuning():
            out, summed = module.tuned_rms_norm_linear(x, res, norm_w, 1e-6, w, None)
            alone, same = module.tuned_rms_norm_linear(x, None, norm_w, 1e-6, w, None)
    finally:
        module._timer, module._num_sms = original
    keys = {r.key: r.chosen for r in tuning.records()[measured:]}
    base = (8, 80, 600, torch.float16, False, None)
    assert keys == {(*base, None): favourite.name,  # the reference's own linear, measured within
                    (*base, ("rms_norm", True, torch.float16)): favourite.name,
                    (*base, ("rms_norm", False, torch.float16)): favourite.name}, keys
    sums = torch.empty(5, 600, dtype=torch.float16, device=device)
    assert torch.equal(out, skinny_linear(x, w, None, favourite, norm=InputNorm(norm_w, 1e-6, res, sums)))
    assert torch.equal(summed, sums) and torch.equal(summed, x + res)
    assert torch.equal(alone, skinny_linear(x, w, None, favourite, norm=InputNorm(norm_w, 1e-6))) and same is x
    torch.testing.assert_close(out.float(), F.linear(normed, w).float(), rtol=2 ** -7, atol=2e-3)
    module._TABLE.clear()


def check_tuned_linear(device: str) -> None:
    """The CUDA linear builder: outside a tuning window an unseen shape takes torch's linear
    and measures nothing; inside one it times the candidates (a stand-in timer here that
    makes one split-K tile fastest) and keeps the fastest, which later calls at any row
    count of the same bucket use, windows closed; more than 16 rows are never measured."""
    from tessera.ops import kernel_tuning as tuning
    from tessera.ops.triton import skinny_linear as module

    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 600, generator=g).to(torch.float16).to(device)
    w = (torch.randn(80, 600, generator=g) / 25).to(torch.float16).to(device)
    key = (8, 80, 600, torch.float16, False, None, None)
    module._TABLE.clear()
    measured = len(tuning.records())
    assert torch.equal(module.tuned_linear(x, w, None), F.linear(x, w, None))
    assert module._TABLE.chosen(key) is None and len(tuning.records()) == measured

    favourite = module.candidate_configs(80, 600, 4)[-1]
    assert favourite.split_k > 1, favourite

    def timer(runs: dict) -> dict[str, float]:  # candidates: partials of (x, weight, bias, config | activation, ...)
        return {name: 1e-5 if run.args[3] == favourite else 2e-5 for name, run in runs.items()}

    original = module._timer, module._num_sms
    module._timer, module._num_sms = (lambda device: timer), (lambda device: 4)
    try:
        with tuning.kernel_tuning():
            assert tuning.tuning_open()
            got = module.tuned_linear(x, w, None)
    finally:
        module._timer, module._num_sms = original
    assert not tuning.tuning_open()
    record = tuning.records()[-1]
    assert record.key == key and record.chosen == favourite.name, record
    assert set(record.timings) == {"torch", *(c.name for c in module.candidate_configs(80, 600, 4))}
    assert torch.equal(got, skinny_linear(x, w, None, favourite))
    fewer = x[:7 - 2]  # 5 rows again, then 7: bucket 8 both
    assert torch.equal(module.tuned_linear(fewer, w, None), skinny_linear(fewer, w, None, favourite))
    seven = torch.cat([x, x[:2]])
    assert torch.equal(module.tuned_linear(seven, w, None), skinny_linear(seven, w, None, favourite))
    many = torch.cat([x] * 4)  # 20 rows
    with tuning.kernel_tuning():
        assert torch.equal(module.tuned_linear(many, w, None), F.linear(many, w, None))
    assert len(tuning.records()) == measured + 1  # only the first window measured

    # the gated down projection: its own shape key (so it is measured on its own), the
    # activation's kernel then cuBLAS as its reference, the same choice logic
    gate_up = torch.randn(5, 1200, generator=g).to(torch.float16).to(device)
    act_then_linear = F.linear(triton_silu_and_mul(gate_up), w, None)
    assert torch.equal(module.tuned_gated_linear(gate_up, w, None, "silu_and_mul"), act_then_linear)
    module._timer, module._num_sms = (lambda device: timer), (lambda device: 4)
    try:
        with tuning.kernel_tuning():
            got = module.tuned_gated_linear(gate_up, w, None, "silu_and_mul")
    finally:
        module._timer, module._num_sms = original
    record = tuning.records()[-1]
    assert record.key == (*key[:-2], "silu_and_mul", None) and record.chosen == favourite.name, record
    assert torch.equal(got, skinny_linear(gate_up, w, None, favourite, "silu_and_mul"))
    torch.testing.assert_close(got.float(), act_then_linear.float(), rtol=2 ** -7, atol=2e-3)
    try:
        module.tuned_gated_linear(gate_up, w, None, "relu")
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown activation accepted")
    module._TABLE.clear()


SKINNY_CHECKS = (check_skinny_linear, check_norm_linear, check_tuned_linear, check_tuned_norm_linear)
