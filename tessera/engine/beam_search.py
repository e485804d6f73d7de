"""Beam search's choice of the next beams: transformers' algorithm (GenerationMixin's
_beam_search, without sampling), for one request whose beams advance in lock step.

A request searches with `width` = best_of (else n) beams; it starts as one sequence, its
prompt. Each step every live beam's row gives its best next tokens by processed logprob
(the sampler's beam candidates). Once all of them have, the group ranks every candidate by
its cumulative logprob (the beam's plus the token's):

- The best `keep` are kept (SamplingParams.beam_candidates: transformers' count, so that
  `width` of them can go on however many end).
- Those among the best `width` that end a beam (an EOS, a stop token id, a stop string
  the token completes, the length limit) become hypotheses, scored cumulative logprob /
  generated tokens ** length_penalty; the best `width` hypotheses are kept.
- The best `width` that do not end are the next beams (a beam continued twice forks; a
  beam nothing continues ends).
- The search stops when nothing can go on, when (`early_stopping` true) `width`
  hypotheses exist, or when the best live beam can no longer beat the worst of `width`
  hypotheses: judged at its current length (`early_stopping` false, transformers' default),
  or at the longest it may grow (`"never"` with a positive length_penalty).

The n best hypotheses are the request's outputs, best first. The engine does the forking
(engine/engine_beams.py); this module only decides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from tessera.engine.sequence import FinishReason, Sequence
from tessera.sampling.sampler import TokenLogprobs

@dataclass
class Candidate:
    """One continuation: `parent` followed by `token`."""

    parent: Sequence
    token: int
    logprob: float
    score: float  # the parent's cumulative logprob + logprob
    rank: int     # 1 = the parent row's most likely token
    row: TokenLogprobs  # the parent row's candidates (for logprobs' alternatives)
    stop: str | None = None  # the stop string its text completes (set by the end rule) ...
    stop_text: str = ""      # ... and its output text up to the stop (or through it)


@dataclass
class Hypothesis:
    score: float  # cumulative logprob / generated tokens ** length_penalty
    candidate: Candidate
    reason: FinishReason
    # the parent's as they were (the parent may go on as another beam)
    parent_token_ids: list[int] = field(default_factory=list)
    parent_logprobs: list | None = None
    parent_cumulative: float = 0.0

    @staticmethod
    def of(candidate: Candidate, reason: FinishReason, score: float) -> "Hypothesis":
        parent = candidate.parent
        return Hypothesis(score, candidate, reason, list(parent.token_ids),
                          None if parent.logprobs is None else list(parent.logprobs), parent.cumulative_logprob)


# whether a candidate ends its beam, and how (None: it goes on)
EndRule = Callable[[Candidate], FinishReason | None]


@dataclass
class BeamSearch:
    width: int
    length_penalty: float
    early_stopping: bool | str
    keep: int  # candidates ranked a step (SamplingParams.beam_candidates)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # transformers' early-stop heuristic, once false for good
    done: bool = False

    def ranked(self, beams: list[Sequence]) -> list[Candidate]:
        """The best `keep` candidates of every beam's row, best first (ties: earlier beam,
        then its row's order)."""
        out = []
        for order, beam in enumerate(beams):
            row: TokenLogprobs = beam.beam_candidates
            for rank, (token, logprob) in enumerate(row.top, 1):
                if math.isfinite(logprob):  # (a masked token is no candidate; nor NaN: all masked)
                    out.append((order, Candidate(beam, token, logprob, beam.cumulative_logprob + logprob, rank, row)))
        out.sort(key=lambda pair: (-pair[1].score, pair[0], pair[1].rank))
        return [candidate for _, candidate in out[:self.keep]]

    def step(self, beams: list[Sequence], ends: EndRule, generated: int, longest: int) -> list[Candidate]:
        """One step of the search over `beams` (each with its beam_candidates): records new
        hypotheses and returns the continuations (at most `width`; none once `done`).
        `generated`: the tokens each beam's continuation will have generated (the beams are
        in lock step); `longest`: the most tokens a beam may generate."""
        ranked = self.ranked(beams)
        endings = [ends(c) for c in ranked]
        full = len(self.hypotheses) >= self.width
        if self.improvable and not (full and self.early_stopping is True):
            for candidate, reason in zip(ranked[:self.width], endings[:self.width]):
                if reason is not None:
                    self._add(Hypothesis.of(candidate, reason, candidate.score / generated ** self.length_penalty))
        going_on = [c for c, reason in zip(ranked, endings) if reason is None][:self.width]
        if going_on:
            self._judge(going_on[0].score, generated, longest)
        full = len(self.hypotheses) >= self.width
        self.done = not going_on or not self.improvable or (self.early_stopping is True and full)
        return [] if self.done else going_on

    def _add(self, hypothesis: Hypothesis) -> None:
        self.hypotheses.append(hypothesis)
        self.hypotheses.sort(key=lambda h: -h.score)  # (stable: an earlier one wins a tie)
        del self.hypotheses[self.width:]

    def _judge(self, best_running: float, generated: int, longest: int) -> None:
        """Whether the best live beam can still beat the worst kept hypothesis (transformers'
        _check_early_stop_heuristic; always while fewer than `width` are kept)."""
        if len(self.hypotheses) < self.width:
            return
        length = longest if self.early_stopping == "never" and self.length_penalty > 0 else generated
        self.improvable = best_running / length ** self.length_penalty > self.hypotheses[-1].score

    def best(self, n: int) -> list[Hypothesis]:
        return self.hypotheses[:n]
