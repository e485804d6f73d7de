"""What every reader of llama.cpp's projector files (arch "clip") shares: its error, its
tensors' shapes in torch's order, and the `clip.vision.*` keys a tower cannot be built
without."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_rope import field_value


class MmprojError(ValueError):
    """A multimodal projector file (--mmproj) that cannot be read, or does not go with its
    language model's GGUF."""


def torch_shape(tensor) -> tuple[int, ...]:
    """A gguf ReaderTensor's shape in torch's order (GGUF lists the fastest dimension first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def vision_key(fields: dict, name: str) -> Any:
    """`clip.vision.<name>`'s value; a file without it is refused."""
    value = field_value(fields, f"clip.vision.{name}")
    if value is None:
        raise MmprojError(f"the mmproj file lacks clip.vision.{name}")
    return value


def image_mean_std(fields: dict) -> tuple[list[float], list[float]]:
    """The image processor's per-channel mean and std (`clip.vision.image_mean` / `_std`),
    which the converter copies from the released preprocessor; a file without them is refused."""
    mean = field_value(fields, "clip.vision.image_mean")
    std = field_value(fields, "clip.vision.image_std")
    if mean is None or std is None:
        raise MmprojError("the mmproj file lacks clip.vision.image_mean / image_std")
    return [float(v) for v in mean], [float(v) for v in std]
