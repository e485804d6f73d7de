"""Parameters that load themselves: each owns a `weight_loader(param, tensor, shard_id)`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable

import torch
from torch import nn

from tessera.weights.lazy import LazyTensor, materialize, narrow

if TYPE_CHECKING:
    from tessera.distributed.parallel import Span


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


def copy_checked(dst: torch.Tensor, src: torch.Tensor | LazyTensor, what: str) -> None:
    src = materialize(src)
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"{what}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def row_spans_loader(full_rows: int, spans: list[tuple[int, "Span"]], what: str) -> Callable:
    """A loader for a parameter that holds some row spans of a checkpoint tensor of
    `full_rows` rows, one after another: for each (offset, span), rows offset + span.start
    onwards (a tensor-parallel rank's heads of each part of a packed conv or per-head
    vector). Trailing dims are reshaped to the parameter's (conv1d's [C, 1, K] into [C, K])."""
    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        tensor = materialize(tensor)
        if tensor.shape[0] != full_rows:
            raise WeightShapeError(f"{what}: checkpoint rows {tensor.shape[0]} != {full_rows}")
        tensor = tensor.reshape(full_rows, *param.shape[1:])
        with torch.no_grad():
            copy_checked(param.data, torch.cat([narrow(tensor, 0, offset + span.start, span.size)
                                                for offset, span in spans]), what)
    return load


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
    with torch.no_grad():
        copy_checked(param.data, tensor, getattr(param, "tessera_name", "parameter"))


def make_param(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
               loader: Callable = default_weight_loader, shard_ids: tuple = ()) -> nn.Parameter:
    """An uninitialised parameter; every element is overwritten by the loader (missing
    weights are an error, so nothing can be left unset)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    param.shard_ids = shard_ids  # packed parameters are complete only when every shard loaded
    return param


def prepared_param(param: nn.Parameter, prepare: Callable[[torch.Tensor], torch.Tensor] | None) -> nn.Parameter:
    """`param`, or a new parameter holding `prepare(param)` when that changes the layout. The
    new one has no weight_loader: preparation happens once, after every shard is loaded."""
    if prepare is None:
        return param
    with torch.no_grad():
        data = prepare(param.data)
    return param if data is param.data else nn.Parameter(data, requires_grad=False)


def prepare_module(module: nn.Module) -> None:
    """Run `module`'s prepare_weights hook, if it has one, unless it ran already (marks it:
    `weights_prepared`)."""
    hook = getattr(module, "prepare_weights", None)
    if callable(hook) and not getattr(module, "weights_prepared", False):
        hook()
        module.weights_prepared = True


def prepare_weights(model: nn.Module) -> None:
    """Let every layer put its loaded weights into its op builders' layouts (packed panels
    for the CPU GEMM, ...). Call once, after loading; layers the loader prepared already
    (`weights_prepared`, weights/loader.py) are skipped."""
    for module in list(model.modules()):
        prepare_module(module)
