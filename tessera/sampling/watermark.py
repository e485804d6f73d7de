"""The green-list watermark of Kirchenbauer et al. ("A Watermark for Large Language
Models", 2023), as TGI's `watermark` parameter and transformers' "lefthash" scheme apply it.

Before each token is chosen, the previous token seeds a torch CPU generator with
`key * previous_token`; the first `int(gamma * V)` entries of a random permutation of the
vocabulary are that step's "green" tokens, and `delta` is added to their logits. Text
written this way holds far more green tokens than the `gamma` share chance gives, which a
z-test on the tokens alone detects: no model, no logits, only the key, gamma and the
tokenizer. The green lists are those of transformers' WatermarkLogitsProcessor
("lefthash", context width 1) with the same key and ratio, and of TGI on a CPU, so
transformers' WatermarkDetector reads tessera's text and the other way round. They come
from torch's CPU `randperm` whatever the device, so text generated on a GPU is detected on
any machine with the same torch version (TGI on a GPU draws with a CUDA generator, whose
lists differ).
"""
from __future__ import annotations

import math
import os
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from tessera.config import DEFAULT_WATERMARK_Z_THRESHOLD as DEFAULT_Z_THRESHOLD, WatermarkConfig
from tessera.platform import to_device

__all__ = ["DEFAULT_Z_THRESHOLD", "GreenLists", "WatermarkConfig", "WatermarkScore",
           "apply_watermark", "detect_watermark", "detect_watermark_in_output"]

_CACHE_BYTES = 64 * 2**20       # green lists kept, bit-packed: ~11k of a 49k vocabulary
_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # bit 7 of a byte is its first entry
_BYTE_BITS = (torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> _BIT_SHIFTS) & 1  # [256, 8]: each byte's entries


class GreenLists:
    """Green lists by previous token, bit-packed ([ceil(V / 8)] uint8, on the host), the
    most recently used kept. A list is one CPU `randperm(V)` (~1 ms at 49k entries, ~2.3 ms
    at 152k), and text keeps revisiting its common tokens; the lists a step misses are drawn
    on several threads (torch releases the GIL)."""

    def __init__(self, config: WatermarkConfig, vocab_size: int, cache_bytes: int = _CACHE_BYTES):
        self.config = config
        self.vocab_size = vocab_size
        self.size = int(vocab_size * config.gamma)
        self.row_bytes = -(-vocab_size // 8)
        self.capacity = max(64, cache_bytes // self.row_bytes)
        self._lists: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._bias_tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def packed(self, previous_tokens: Sequence[int]) -> torch.Tensor:
        """[R, ceil(V / 8)] uint8: row r holds the list after previous_tokens[r], bit-packed."""
        missing = sorted({t for t in previous_tokens if t not in self._lists})
        if len(missing) > 1:
            # a pool per step, not one kept: idle workers that ran torch ops slowed the steps
            # after them (32 cached rows: 2.3-4.5 ms instead of 0.9-1.2)
            with ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1)) as pool:
                drawn = list(pool.map(self._draw, missing))
        else:
            drawn = [self._draw(t) for t in missing]
        self._lists.update(zip(missing, drawn))
        for token in previous_tokens:
            self._lists.move_to_end(token)
        out = torch.stack([self._lists[t] for t in previous_tokens])
        while len(self._lists) > max(self.capacity, len(set(previous_tokens))):
            self._lists.popitem(last=False)
        return out

    def _draw(self, previous_token: int) -> torch.Tensor:
        # transformers' reduction; TGI's seed is the same for every key * token below 2**64
        generator = torch.Generator().manual_seed(self.config.key * previous_token % (2**64 - 1))
        green = torch.randperm(self.vocab_size, generator=generator)[:self.size]
        mask = torch.zeros(self.row_bytes * 8, dtype=torch.uint8)
        mask[green] = 1
        return (mask.view(-1, 8) << _BIT_SHIFTS).sum(dim=1, dtype=torch.uint8)

    def bias_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[256, 8]: delta x each byte's entries, on `device` (made once per device and dtype)."""
        key = (device, dtype)
        if key not in self._bias_tables:
            self._bias_tables[key] = to_device(_BYTE_BITS.to(dtype) * self.config.delta, device)
        return self._bias_tables[key]

    def mask(self, previous_token: int) -> torch.Tensor:
        """[V] bool: the tokens that are green right after `previous_token` (a new tensor)."""
        return unpack(self.packed([previous_token]), self.vocab_size)[0].bool()

    def is_green(self, previous_token: int, token: int) -> bool:
        return _green_pairs(self, [(previous_token, token)])[previous_token, token]


def unpack(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 8)] uint8 -> [R, V] uint8 of 0 / 1, on the packed tensor's device."""
    return _BYTE_BITS.to(packed.device)[packed.long()].flatten(1)[:, :vocab_size]


def apply_watermark(logits: torch.Tensor, rows: list[int], previous_tokens: list[int],
                    green: GreenLists) -> torch.Tensor:
    """Add delta to the green logits of `rows` (each after its `previous_tokens` entry), in
    place on `logits` [B, V]. The lists cross to the device bit-packed (V / 8 bytes a row)
    and become the bias by one lookup of each byte's 8 values (1.5-2.5x faster on a CPU than
    shifting the bits out and scaling them)."""
    device = logits.device
    packed = to_device(green.packed(previous_tokens), device).long()
    bias = torch.nn.functional.embedding(packed, green.bias_table(device, logits.dtype))
    return logits.index_add_(0, to_device(torch.tensor(rows), device), bias.flatten(1)[:, :green.vocab_size])


@dataclass
class WatermarkScore:
    """A text's test result. `prediction`: watermarked, i.e. z_score > the threshold."""

    num_tokens_scored: int
    num_green_tokens: int
    green_fraction: float
    z_score: float
    p_value: float          # the chance of this many green tokens or more in text not watermarked
    prediction: bool
    z_threshold: float


def detect_watermark(token_ids: Sequence[int], vocab_size: int, config: WatermarkConfig, *,
                     z_threshold: float = DEFAULT_Z_THRESHOLD,
                     ignore_repeated_bigrams: bool = False) -> WatermarkScore:
    """Score `token_ids`: every token after the first, against the green list its
    predecessor seeds (put the prompt's last token first to score the first generated
    one). `ignore_repeated_bigrams` counts each (previous, token) pair once, so text that
    repeats itself cannot pass on a few lucky pairs (the paper's option)."""
    ids = [int(t) for t in token_ids]
    if len(ids) < 2:
        raise ValueError(f"a watermark test needs at least 2 tokens (the first only seeds the "
                             f"second's green list); got {len(ids)}")
    pairs = Counter(zip(ids, ids[1:]))
    hits = _green_pairs(GreenLists(config, vocab_size), list(pairs))
    if ignore_repeated_bigrams:
        scored, greens = len(pairs), sum(hits.values())
    else:
        scored, greens = len(ids) - 1, sum(count for pair, count in pairs.items() if hits[pair])
    gamma = config.gamma
    z = (greens - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return WatermarkScore(num_tokens_scored=scored, num_green_tokens=greens,
                          green_fraction=greens / scored, z_score=z,
                          p_value=0.5 * math.erfc(z / math.sqrt(2)),
                          prediction=z > z_threshold, z_threshold=z_threshold)


def _green_pairs(green: GreenLists, pairs: list[tuple[int, int]]) -> dict[tuple[int, int], bool]:
    """Whether each (previous, token) pair's token is green: the lists of a cache's worth of
    previous tokens drawn at once (on the pool), each then read for all its pairs."""
    following: dict[int, list[int]] = {}
    for previous, token in pairs:
        following.setdefault(previous, []).append(token)
    previous_tokens = sorted(following)
    hits = {}
    for start in range(0, len(previous_tokens), green.capacity):
        chunk = previous_tokens[start:start + green.capacity]
        for previous, row in zip(chunk, green.packed(chunk).numpy()):
            for token in following[previous]:
                hits[previous, token] = (0 <= token < green.vocab_size
                                         and bool(row[token >> 3] >> (7 - (token & 7)) & 1))
    return hits


def detect_watermark_in_output(tokenizer, vocab_size: int, config: WatermarkConfig,
                               output: str | Sequence[int], *, prompt: str | Sequence[int] | None = None,
                               z_threshold: float = DEFAULT_Z_THRESHOLD,
                               ignore_repeated_bigrams: bool = False) -> WatermarkScore:
    """detect_watermark on a generated output: its token ids, or its text as `tokenizer`
    reads it (no special tokens added; text that does not re-tokenize as generated scores a
    little lower). With the `prompt` it answered (ids, or text tokenized as the engine
    tokenizes prompts), the prompt's last token seeds the first token's list, so that
    token is scored too."""
    ids = list(tokenizer(output, add_special_tokens=False).input_ids) if isinstance(output, str) else list(output)
    if prompt is not None:
        ids = list(tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt)[-1:] + ids
    return detect_watermark(ids, vocab_size, config, z_threshold=z_threshold,
                            ignore_repeated_bigrams=ignore_repeated_bigrams)
