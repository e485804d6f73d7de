"""Kernel choice by measurement (tessera/ops/kernel_tuning.py): the fastest candidate that
agrees with the reference wins, by more than the minimum gain; one that raises or
disagrees is dropped with the reason; the window opens and closes (nested too). The
Triton builder that uses it is checked in tests/ops/triton_cases.py."""
from __future__ import annotations

import logging

import pytest
import torch

from tessera.ops import kernel_tuning
from tessera.ops.kernel_tuning import TacticTable, kernel_tuning as tuning_window, tuning_open

WANT = torch.arange(6, dtype=torch.float32)


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want)


def _tune(table: TacticTable, times: dict[str, float], outputs: dict[str, object] | None = None,
          key="k") -> str:
    outputs = outputs or {}

    def make(name: str):
        def run():
            run.ran = True
            out = outputs.get(name, WANT)
            if isinstance(out, Exception):
                raise out
            return out
        run.ran = False
        return run

    def timer(runs: dict) -> dict[str, float]:
        assert all(run.ran for run in runs.values())  # checked (and compiled) before timing
        timed.append(sorted(runs))
        return {name: times[name] for name in runs}

    timed: list[list[str]] = []
    runs = {name: make(name) for name in times}
    chosen = table.tune(key, runs, timer=timer, agrees=_agrees)
    assert len(timed) == 1 and set(timed[0]) == {n for n in times if not isinstance(outputs.get(n), Exception)
                                                and (n == table.reference or outputs.get(n) is None)}
    return chosen


def test_the_fastest_agreeing_candidate_wins_and_is_remembered():
    table = TacticTable("linear", reference="torch")
    assert table.chosen("k") is None
    assert _tune(table, {"torch": 10.0, "a": 8.0, "b": 6.0, "c": 7.0}) == "b"
    assert table.chosen("k") == "b" and table.chosen("other") is None
    record = kernel_tuning.records()[-1]
    assert (record.op, record.key, record.chosen, record.rejected) == ("linear", "k", "b", {})
    assert record.timings == {"torch": 10.0, "a": 8.0, "b": 6.0, "c": 7.0}
    assert "1.67x the reference" in record.describe()
    table.clear()
    assert table.chosen("k") is None


def test_a_candidate_must_beat_the_reference_by_the_minimum_gain():
    table = TacticTable("linear", reference="torch", min_gain=0.05)
    assert _tune(table, {"torch": 10.0, "a": 9.6}) == "torch"  # 4% faster: noise
    assert _tune(table, {"torch": 10.0, "a": 9.4}, key="k2") == "a"
    assert _tune(table, {"a": 12.0, "torch": 10.0}, key="k3") == "torch"


def test_candidates_that_fail_or_disagree_are_dropped_with_the_reason():
    table = TacticTable("linear", reference="torch")
    chosen = _tune(table, {"torch": 10.0, "wrong": 1.0, "broken": 2.0, "nan": 3.0, "ok": 5.0},
                   {"wrong": WANT + 1, "broken": RuntimeError("out of shared memory"),
                    "nan": torch.full((6,), float("nan"))})
    assert chosen == "ok"
    record = kernel_tuning.records()[-1]
    assert record.rejected["wrong"] == "disagrees with the reference"
    assert record.rejected["broken"] == "RuntimeError: out of shared memory"
    assert set(record.rejected) == {"wrong", "broken", "nan"}
    assert record.timings["wrong"] is None and record.timings["broken"] is None


def test_a_failed_measurement_keeps_the_reference(caplog):
    table = TacticTable("linear", reference="torch")

    def broken_timer(runs):
        raise RuntimeError("CUDA events unavailable")

    with caplog.at_level(logging.WARNING, logger="tessera.ops.kernel_tuning"):
        chosen = table.tune("k", {"torch": lambda: WANT, "a": lambda: WANT}, timer=broken_timer, agrees=_agrees)
    assert chosen == "torch" and table.chosen("k") == "torch"
    assert "timing failed, keeping torch" in caplog.text
    record = kernel_tuning.records()[-1]
    assert record.timings == {"torch": None, "a": None} and record.describe().endswith("(not timed)")


def test_a_failing_reference_is_the_ops_own_error():
    table = TacticTable("linear", reference="torch")
    with pytest.raises(ValueError, match="bad"):
        _tune(table, {"torch": 10.0, "a": 1.0}, {"torch": ValueError("bad")})
    assert table.chosen("k") is None


def test_the_window_nests_and_reports_what_it_measured(caplog):
    table = TacticTable("linear", reference="torch")
    assert not tuning_open()
    with caplog.at_level(logging.INFO, logger="tessera.ops.kernel_tuning"):
        with tuning_window():
            assert tuning_open()
            with tuning_window():
                _tune(table, {"torch": 10.0, "a": 5.0}, key="w1")
            assert tuning_open()
            assert not [r for r in caplog.records if "kernel tuning" in r.getMessage()]  # not yet
            _tune(table, {"torch": 10.0, "a": 11.0}, key="w2")
        assert not tuning_open()
    summary = [r.getMessage() for r in caplog.records if "kernel tuning" in r.getMessage()]
    assert len(summary) == 1 and "2 shapes measured" in summary[0] and "chosen for 1" in summary[0]
    with pytest.raises(KeyError):
        with tuning_window():
            raise KeyError("a failed pass")
    assert not tuning_open()


def test_the_few_row_linear_check_passes_rounding_and_catches_a_wrong_column():
    from tessera.ops.triton.skinny_linear import _agrees

    want = torch.randn(4, 50000, generator=torch.Generator().manual_seed(0)) * 3
    assert _agrees(want.bfloat16(), want) and _agrees(want.half(), want)  # the output's rounding
    for broken in (want.clone().index_fill_(1, torch.tensor([7]), 0.0), want * 1.05,
                   want.clone().index_fill_(1, torch.tensor([49999]), float("nan"))):
        assert not _agrees(broken, want)
