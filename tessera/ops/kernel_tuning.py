"""Kernel choice by measurement, at start-up (TensorRT-LLM's tactic selection, Triton's
autotuner), for builders whose best kernel depends on the shape and the chip.

A builder with several ways to compute an op (a library call and kernels of its own, say)
keeps a `TacticTable`. While the runner holds a tuning window open (`kernel_tuning()`:
the warm-up passes before CUDA graphs are captured), a call whose shape has no choice yet
runs every candidate on its real inputs, drops any that raises or disagrees with the
reference, times the rest and records the fastest; outside a window an unseen shape
takes the reference, so serving never pauses to measure. Choices are per process and per
shape, shared by every layer of that shape.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator

import torch

logger = logging.getLogger(__name__)

Tactic = Callable[[], torch.Tensor]  # a candidate bound to the call's inputs

_open_windows = 0


@contextlib.contextmanager
def kernel_tuning() -> Iterator[None]:
    """While open, builders may measure their candidates for shapes they have not seen."""
    global _open_windows
    _open_windows += 1
    started, first = time.perf_counter(), len(_RECORDS)
    try:
        yield
    finally:
        _open_windows -= 1
        tuned = _RECORDS[first:]
        if tuned and not _open_windows:
            faster = sum(r.chosen != r.reference for r in tuned)
            logger.info("kernel tuning: %d shapes measured in %.1f s, a kernel faster than the "
                        "reference chosen for %d", len(tuned), time.perf_counter() - started, faster)


def tuning_open() -> bool:
    return _open_windows > 0


_tuned_rows = 0


def tunes_up_to(rows: int) -> None:
    """A builder declares the most rows it measures at, so a runner opening a window
    runs passes only at sizes where something is measured."""
    global _tuned_rows
    _tuned_rows = max(_tuned_rows, rows)


def tuned_row_limit() -> int:
    """The most rows any registered builder measures at (0: none measures)."""
    return _tuned_rows


@dataclass
class TuningRecord:
    """What one shape's measurement found (seconds per call; None: failed or disagreed)."""

    op: str
    key: Hashable
    reference: str
    chosen: str
    timings: dict[str, float | None]
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why

    def describe(self) -> str:
        best = self.timings[self.chosen]
        if best is None:
            return f"{self.op} {self.key}: {self.chosen} (not timed)"
        ref = self.timings.get(self.reference)
        gain = f", {ref / best:.2f}x the reference" if ref and self.chosen != self.reference else ""
        return f"{self.op} {self.key}: {self.chosen} ({best * 1e6:.1f} us{gain})"


_RECORDS: list[TuningRecord] = []


def records() -> list[TuningRecord]:
    """Every measurement made in this process, in order (for inspection and benchmarks)."""
    return list(_RECORDS)


class TacticTable:
    """One builder's choices: key -> the name of the chosen candidate."""

    def __init__(self, op: str, reference: str, min_gain: float = 0.03):
        self.op = op
        self.reference = reference  # the candidate that is always correct and always there
        self.min_gain = min_gain    # a candidate must beat the reference by this fraction
        self._chosen: dict[Hashable, str] = {}

    def chosen(self, key: Hashable) -> str | None:
        return self._chosen.get(key)

    def clear(self) -> None:
        self._chosen.clear()

    def tune(self, key: Hashable, candidates: dict[str, Tactic],
             timer: Callable[[dict[str, Tactic]], dict[str, float]],
             agrees: Callable[[torch.Tensor, torch.Tensor], bool]) -> str:
        """Run every candidate once (compiling it) and drop any that raises or whose output
        does not `agree` with the reference's; then `timer` times the rest together (it
        may interleave them, so none is favoured by the clock or the order) and the
        fastest is recorded. If timing fails the reference is kept. A kernel that faults
        on the device is not caught here: CUDA reports that later, and for the context."""
        want = candidates[self.reference]()
        survivors: dict[str, Tactic] = {}
        rejected: dict[str, str] = {}
        for name, run in candidates.items():
            try:
                if name == self.reference or agrees(run(), want):
                    survivors[name] = run
                else:
                    rejected[name] = "disagrees with the reference"
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is no choice
                rejected[name] = f"{type(exc).__name__}: {exc}"[:300]
        try:
            measured = timer(survivors)
        except Exception as exc:  # noqa: BLE001 - measuring failed: the reference is always right
            logger.warning("%s %s: timing failed, keeping %s: %s", self.op, key, self.reference, exc)
            measured = {}
        timings: dict[str, float | None] = {name: measured.get(name) for name in candidates}
        chosen = self.reference
        if timings[self.reference] is not None:
            bar = timings[self.reference] * (1.0 - self.min_gain)
            for name, seconds in timings.items():
                if seconds is not None and seconds < bar and seconds < timings[chosen]:
                    chosen = name
        self._chosen[key] = chosen
        record = TuningRecord(self.op, key, self.reference, chosen, timings, rejected)
        _RECORDS.append(record)
        logger.debug("%s%s", record.describe(),
                     "".join(f"; {n} rejected: {why}" for n, why in rejected.items()))
        return chosen
