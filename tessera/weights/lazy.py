"""Checkpoint tensors read on demand: a tensor-parallel rank reads only its slice."""
from __future__ import annotations

import torch


# safetensors' dtype names -> torch's
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
           "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class LazyTensor:
    """A safetensors tensor not read yet. `narrow` reads one slice of it from the file,
    `load` reads all of it."""

    def __init__(self, handle, name: str):
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.name = name

    @property
    def dtype(self) -> torch.dtype | None:
        """The stored type (None for one torch does not have)."""
        return _DTYPES.get(self._slice.get_dtype())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        if not self.shape:  # a scalar (Gemma 4's clipping bounds): slices do not apply
            return self._handle.get_tensor(self.name)
        return self._slice[:]


def materialize(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


def narrow(tensor: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """A slice of a checkpoint tensor, read from the file only for that slice when lazy."""
    if start < 0 or start + length > tensor.shape[dim]:
        raise ValueError(f"slice [{start}, {start + length}) of dim {dim} is outside shape {tuple(tensor.shape)}")
    return tensor.narrow(dim, start, length)
