"""N-gram (prompt lookup) proposals for speculative decoding.

A sequence's last n tokens are looked up among its earlier tokens (prompt and output); the
tokens that followed their most recent earlier occurrence are the proposal. The longest n
in [prompt_lookup_min, prompt_lookup_max] that occurs wins. A match close to the end reads
on into its own proposal, so a sequence caught in a loop of period p is proposed the whole
loop, not just the p tokens before the end.

Each sequence's tokens are mirrored into a growing numpy array (only new tokens are
copied), so a lookup costs a vectorised scan, not a Python pass over the history.
"""
from __future__ import annotations

import weakref

import numpy as np

from tessera.config import SpeculativeConfig
from tessera.engine.scheduler import ScheduledSeq
from tessera.engine.sequence import Sequence


def propose_ngram(tokens: np.ndarray, num_tokens: int, max_proposal: int,
                  min_n: int, max_n: int) -> list[int]:
    """Up to `max_proposal` tokens to follow tokens[:num_tokens], or [] with no match of at
    least `min_n` tokens."""
    if max_proposal <= 0 or num_tokens <= min_n:
        return []
    history = tokens[:num_tokens]
    last = num_tokens - 1
    # candidate ends of an earlier occurrence: where the final token occurs before the end
    ends = np.flatnonzero(history[:last] == history[last])
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # matched tokens, counting back from each end
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        if back > last:
            break
        starts = ends - back
        alive &= starts >= 0
        alive[alive] = history[starts[alive]] == history[last - back]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    proposal: list[int] = []
    for i in range(end + 1, end + 1 + max_proposal):
        proposal.append(int(history[i]) if i < num_tokens else proposal[i - num_tokens])
    return proposal


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        # per live sequence (dropped with it): (its tokens as int64, how many are filled in)
        self._arrays: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, int]] = (
            weakref.WeakKeyDictionary())

    def propose(self, seq: Sequence) -> list[int]:
        """Draft tokens for `seq`'s next step, never more than its length limits leave room
        for (every accepted draft is an output token, and one more always follows)."""
        room = min(self.config.num_speculative_tokens,
                   seq.params.max_new_tokens - seq.num_output_tokens - 1,
                   seq.max_total_tokens - seq.num_tokens - 1)
        if room <= 0:
            return []
        tokens = self._tokens(seq)
        return propose_ngram(tokens, seq.num_tokens, room,
                             self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def fill(self, scheduled: list[ScheduledSeq]) -> None:
        """Nothing to do: the drafts the scheduler kept are the proposals themselves (a draft
        model's proposer writes its tokens here, once the scheduler has given them slots)."""

    def _tokens(self, seq: Sequence) -> np.ndarray:
        array, filled = self._arrays.get(seq, (None, 0))
        n = seq.num_tokens
        if array is None or array.size < n:
            grown = np.empty(max(2 * n, 256), dtype=np.int64)
            if array is not None:
                grown[:filled] = array[:filled]
            array = grown
        if filled < n:
            array[filled:n] = seq.token_ids[filled:n]
        self._arrays[seq] = (array, n)
        return array
