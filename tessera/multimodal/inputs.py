"""What a request's images become once processed: where their placeholder tokens sit in the
prompt, the encoder's inputs, and (while the prompt is being computed) the encoder's output."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageSpan:
    """One image's placeholder tokens: prompt positions [start, end) hold them (maybe with
    text markers in between, as in tiled layouts), and `content_hash` names its pixels."""

    start: int
    end: int
    content_hash: bytes


@dataclass(eq=False)
class MultimodalInputs:
    images: list[ImageSpan]
    # the prompt positions whose embedding rows are image features, ascending: the i-th
    # takes the encoder's i-th output row
    feature_positions: list[int]
    # what the model's encoder takes (pixel values and the like), on the CPU
    encoder_inputs: dict[str, torch.Tensor]
    # the encoder's output [len(feature_positions), hidden], computed by the runner when a
    # step first needs it and dropped once the prompt is past its last image
    embeddings: torch.Tensor | None = field(default=None, repr=False)
    # M-RoPE models: each prompt token's rotary position (a text token's, shared by its
    # three components; for an image token, its temporal one), the image tokens' 3-D
    # positions [3, len(feature_positions)], and what output token p is at: p + rope_delta
    rope_positions: list[int] | None = None
    image_rope: torch.Tensor | None = None
    rope_delta: int = 0

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

    def hashes_between(self, start: int, end: int) -> tuple[bytes, ...]:
        """The content hashes of the images with placeholder tokens in [start, end): mixed
        into the prefix-cache key of a block there, so the same placeholder ids with other
        pixels never share KV."""
        return tuple(image.content_hash for image in self.images if image.start < end and start < image.end)
