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

DUMMY_RANGE = 0.02


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> int:
    """Fill every parameter (each shared one once); returns how many were filled."""
    count = 0
    own: set[int] = set()
    for module_name, module in model.named_modules():
        fill = getattr(module, "fill_dummy", None)
        if callable(fill):
            params = list(module.parameters(recurse=False))
            fill(torch.Generator(device=params[0].device).manual_seed(seed * 1_000_003 + zlib.crc32(module_name.encode())))
            own.update(id(p) for p in params)
            count += len(params)
    for name, param in model.named_parameters():
        if id(param) in own:
            continue
        # drawn where the parameter lives: one CPU generator would fill an 8B model on a GPU
        # serially in host memory, then copy it over
        generator = torch.Generator(device=param.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device).uniform_(
            -DUMMY_RANGE, DUMMY_RANGE, generator=generator)
        param.copy_(values.to(param.dtype))
        count += 1
    return count
