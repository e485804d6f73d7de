"""What a request's images become once processed: where each image's tokens sit in the
prompt, its own encoder inputs, and (while the prompt is being computed) its features."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable

import torch

# an image's features from its encoder inputs and content hash (the runner's encoder, with
# its cache of images seen before)
Encoder = Callable[[dict[str, torch.Tensor], bytes], torch.Tensor]


@dataclass(eq=False)
class PromptImage:
    """One image of a prompt: its tokens lie in prompt positions [start, end) (maybe with
    text markers in between, as in tiled layouts) and are feature rows [first_feature,
    first_feature + num_features) of the prompt; `content_hash` names its pixels."""

    start: int
    end: int
    content_hash: bytes
    first_feature: int
    num_features: int
    encoder_inputs: dict[str, torch.Tensor] = field(repr=False)  # this image's alone, on the CPU
    # the encoder's output [num_features, hidden] while steps of the prompt need it
    embeddings: torch.Tensor | None = field(default=None, repr=False)

    @property
    def end_feature(self) -> int:
        return self.first_feature + self.num_features


@dataclass(eq=False)
class MultimodalInputs:
    images: list[PromptImage]
    # the prompt positions whose embedding rows are image features, ascending: the i-th
    # takes feature row i (image k's rows are its first_feature ...)
    feature_positions: list[int]
    # M-RoPE models: each prompt token's rotary position (a text token's, shared by its
    # three components; for an image token, its temporal one), the image tokens' 3-D
    # positions [3, len(feature_positions)], and what output token p is at: p + rope_delta
    rope_positions: list[int] | None = None
    image_rope: torch.Tensor | None = None
    rope_delta: int = 0
    # models whose image tokens attend to each other (Gemma 3): each run [start, end) of
    # consecutive image tokens, whose rows all see the whole run; empty: causal throughout
    attention_spans: list[tuple[int, int]] = field(default_factory=list)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prompt chunk [start, end) may end: never inside an attention span, whose
        rows need all its keys in one step. Before the span, or, where the chunk starts in
        it or at it, at its end (past `end`: the step takes the whole span)."""
        for a, b in self.attention_spans:
            if a < end < b:
                return a if a > start else b
        return end

    def key_limits(self, start: int, end: int) -> list[int] | None:
        """The last key position each of prompt positions [start, end) sees, or None when
        each sees up to itself (nothing of an attention span there)."""
        spans = [(a, b) for a, b in self.attention_spans if a < end and start < b]
        if not spans:
            return None
        limits = list(range(start, end))
        for a, b in spans:
            limits[max(a, start) - start:min(b, end) - start] = [b - 1] * (min(b, end) - max(a, start))
        return limits

    def rope_position(self, position: int) -> int:
        if self.rope_positions is None:
            return position
        return self.rope_positions[position] if position < len(self.rope_positions) else position + self.rope_delta

    @property
    def num_features(self) -> int:
        return len(self.feature_positions)

    def features_between(self, start: int, end: int) -> tuple[int, int]:
        """[lo, hi): the feature rows of prompt positions in [start, end)."""
        return (bisect_left(self.feature_positions, start), bisect_left(self.feature_positions, end))

    def features(self, lo: int, hi: int, encode: Encoder) -> torch.Tensor:
        """Feature rows [lo, hi), encoding (one image at a time, so the encoder's peak is one
        image's) the images not held yet."""
        parts = []
        for image in self.images:
            if image.end_feature <= lo or image.first_feature >= hi:
                continue
            if image.embeddings is None:
                embeddings = encode(image.encoder_inputs, image.content_hash)
                if embeddings.shape[0] != image.num_features:
                    raise RuntimeError(f"the vision encoder gave {embeddings.shape[0]} features for an image "
                                       f"of {image.num_features} tokens")
                image.embeddings = embeddings
            first = max(lo, image.first_feature) - image.first_feature
            parts.append(image.embeddings[first:min(hi, image.end_feature) - image.first_feature])
        return torch.cat(parts)

    def release(self, before: int) -> None:
        """Let go of the features of images whose rows all lie before row `before`."""
        for image in self.images:
            if image.end_feature <= before:
                image.embeddings = None

    def hashes_between(self, start: int, end: int) -> tuple[bytes, ...]:
        """The content hashes of the images with placeholder tokens in [start, end): mixed
        into the prefix-cache key of a block there, so the same placeholder ids with other
        pixels never share KV."""
        return tuple(image.content_hash for image in self.images if image.start < end and start < image.end)


def consecutive_runs(positions: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive values in ascending `positions`."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
