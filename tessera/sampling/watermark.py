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
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from tessera.config import WatermarkConfig
from tessera.platform import to_device

__all__ = ["DEFAULT_Z_THRESHOLD", "GreenLists", "WatermarkConfig", "WatermarkScore",
           "apply_watermark", "detect_watermark", "detect_watermark_in_output"]

DEFAULT_Z_THRESHOLD = 4.0       # the paper's: a false positive about once in 30,000 texts
_CACHE_BYTES = 32 * 2**20       # green masks kept, one byte per vocabulary entry each


class GreenLists:
    """Green masks ([V] bool, on the host) by previous token, the most recent kept: one
    permutation of a 49k vocabulary takes ~0.5 ms, and text revisits its common tokens."""

    def __init__(self, config: WatermarkConfig, vocab_size: int, cache_bytes: int = _CACHE_BYTES):
        self.config = config
        self.vocab_size = vocab_size
        self.size = int(vocab_size * config.gamma)
        self.capacity = max(16, cache_bytes // max(vocab_size, 1))
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._generator = torch.Generator()

    def mask(self, previous_token: int) -> torch.Tensor:
        """The tokens that are green right after `previous_token`."""
        mask = self._masks.get(previous_token)
        if mask is not None:
            self._masks.move_to_end(previous_token)
            return mask
        # transformers' reduction; TGI's seed is the same for every key * token below 2**64
        self._generator.manual_seed(self.config.key * previous_token % (2**64 - 1))
        green = torch.randperm(self.vocab_size, generator=self._generator)[:self.size]
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[green] = True
        self._masks[previous_token] = mask
        if len(self._masks) > self.capacity:
            self._masks.popitem(last=False)
        return mask

    def is_green(self, previous_token: int, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(self.mask(previous_token)[token])


def apply_watermark(logits: torch.Tensor, rows: list[int], previous_tokens: list[int],
                    green: GreenLists) -> torch.Tensor:
    """Add delta to the green logits of `rows` (each after its `previous_tokens` entry), in
    place on `logits` [B, V]; one [R, V] mask crosses to the device."""
    masks = torch.stack([green.mask(token) for token in previous_tokens])
    bias = to_device(masks, logits.device).to(logits.dtype).mul_(green.config.delta)
    return logits.index_add_(0, to_device(torch.tensor(rows), logits.device), bias)


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
    green = GreenLists(config, vocab_size)
    pairs = Counter(zip(ids, ids[1:]))
    hits = {pair: green.is_green(*pair) for pair in pairs}
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
