"""`--load-format dummy`: seeded random weights instead of a checkpoint, so a real model
config (say Llama-3-8B's config.json alone) can be benchmarked at its true shapes with
nothing downloaded or read. Values are small (uniform in +-0.02) so activations stay
finite through deep stacks. Each parameter draws from its own generator seeded by its
name, so replicated parameters (norms, routers) are identical on every tensor-parallel
rank of one device type; sharded ones are random either way. A module whose parameters
are not plain numbers (packed MXFP4 codes and scales) fills them itself (`fill_dummy`)."""
from __future__ import annotations

import zlib

import torch
from torch import nn

from tessera.ops.weights import prepare_module

DUMMY_RANGE = 0.02
CHUNK_ELEMENTS = 1 << 26  # drawn at a time: an expert stack's float32 draw would be GBs at once


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> int:
    """Fill every parameter (each shared one once); returns how many were filled. A module
    with a `prepare_weights` hook is prepared as soon as its own parameters are filled, as
    checkpoint loading does (weights/loader.py), so a quantized model (say a mixture of
    experts in int4) never sits whole in the model dtype."""
    count = 0
    filled: set[int] = set()
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        fill = getattr(module, "fill_dummy", None)
        if callable(fill) and params:
            fill(torch.Generator(device=params[0][1].device).manual_seed(
                seed * 1_000_003 + zlib.crc32(module_name.encode())))
            filled.update(id(p) for _, p in params)
            count += len(params)
        for local_name, param in params:
            if id(param) in filled:  # (a shared parameter is named, and seeded, where first met)
                continue
            name = f"{module_name}.{local_name}" if module_name else local_name
            # drawn where the parameter lives: one CPU generator would fill an 8B model on a GPU
            # serially in host memory, then copy it over
            generator = torch.Generator(device=param.device).manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode()))
            _fill_uniform(param.data, generator)
            filled.add(id(param))
            count += 1
        if params:
            prepare_module(module)
    return count


def _fill_uniform(data: torch.Tensor, generator: torch.Generator) -> None:
    """Uniform values in +-DUMMY_RANGE, drawn in float32 CHUNK_ELEMENTS at a time (all at
    once for all but the largest tensors)."""
    flat = data.view(-1) if data.is_contiguous() and data.numel() > CHUNK_ELEMENTS else None
    for chunk in (data,) if flat is None else flat.split(CHUNK_ELEMENTS):
        values = torch.empty(chunk.shape, dtype=torch.float32, device=data.device).uniform_(
            -DUMMY_RANGE, DUMMY_RANGE, generator=generator)
        chunk.copy_(values.to(data.dtype))
