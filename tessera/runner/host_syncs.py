"""Which ops of a forward pass make the host wait on the device, or move data between them.

A CUDA graph replays device work only: a pass that reads a value back on the host
(`.item()`, `.tolist()`, `bool(t.any())`), sizes an output from data (`nonzero`, `unique`,
`bincount`, boolean-mask indexing) or copies between host and device inside the pass cannot
be captured (CUDA refuses such calls while a stream captures) and, if it could, would
replay stale values. Mixture-of-experts routing grouped on the host and rotary scalings
chosen by sequence length are such passes. The CUDA graph capture runs one eager pass
under `HostSyncRecorder` first and, when it records anything, leaves decode eager with the
ops named, instead of failing inside the capture.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result size or value the host must read before it can go on
_SYNCING = {
    aten.item,  # .item(), bool(tensor), int(tensor) (seen as itself under inference_mode)
    aten._local_scalar_dense,  # the same, decomposed
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
}
_COPIES = {aten._to_copy, aten.copy_, aten.copy}
_INDEXING = {aten.index, aten.index_put, aten.index_put_}  # by a boolean mask: sized from data


def _devices(tree) -> set[torch.device]:
    return {t.device for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0}


def _repeats_from_data(args: tuple, kwargs: dict) -> bool:
    """repeat_interleave sizes its output from its repeats tensor unless output_size is given
    (repeats: the first argument of repeat_interleave(repeats), the second of
    repeat_interleave(self, repeats); an int count is known on the host)."""
    repeats = args[0] if len(args) == 1 else args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and kwargs.get("output_size") is None


class HostSyncRecorder(TorchDispatchMode):
    """Records (by name, once each, in order) the ops run inside it that sync with the host
    or copy between devices; every op still runs as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        syncs = packet in _SYNCING or (packet is aten.repeat_interleave and _repeats_from_data(args, kwargs))
        masked = packet in _INDEXING and any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in tree_leaves(args[1:2]))
        # a copy whose tensors (0-d scalars aside) are not all on one device
        crosses = packet in _COPIES and len(_devices((args, kwargs, out))) > 1
        if (syncs or masked or crosses) and str(packet) not in self.ops:
            self.ops.append(str(packet))
        return out
