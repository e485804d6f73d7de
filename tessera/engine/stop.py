"""Stop strings over the incrementally detokenized text.

A stop string may span any number of tokens, so it is searched in the decoded text, in
the window where a match could end in the characters the newest token added. While a
sequence runs, the longest end of its text that could still grow into a stop string is
held back from the stream, so neither a stop string nor any text after it is ever handed
out; once the text can no longer be a stop, it is released. With
`include_stop_str_in_output` nothing needs holding back: the text up to and including
the stop is output, and what follows it is trimmed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class StopMatch:
    stop: str
    start: int  # index of the stop string in the text

    def end(self, include: bool) -> int:
        """Where the visible text ends: before the stop, or after it when it is included."""
        return self.start + (len(self.stop) if include else 0)


def find_stop(text: str, num_new_chars: int, stops: Sequence[str]) -> StopMatch | None:
    """The earliest stop string occurrence ending within the last `num_new_chars`
    characters of `text` (ties: the longer stop)."""
    best: StopMatch | None = None
    if num_new_chars <= 0:
        return None
    for stop in stops:
        start = max(len(text) - num_new_chars - len(stop) + 1, 0)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best.start
                        or (i == best.start and len(stop) > len(best.stop))):
            best = StopMatch(stop, i)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some stop string
    (text that must be held back: the next token may complete the stop)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
