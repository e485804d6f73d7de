"""The base class of the op layers (Linear, RMSNorm, Attention, ...): the leaves every model
is assembled from.

Calling an op layer runs its `forward` directly. nn.Module's call path checks the global and
per-module hook registries on every call (~1.3 us); a decode step at batch 1 makes ~370 such
calls, and skipping that machinery for the leaves took 0.75 ms off an 11 ms step of the
default model (int8, 2 threads). The cost: forward hooks and pre-hooks registered on op
layers do not run (tessera registers none; register them on the model's own modules,
which keep nn.Module's behaviour).
"""
from __future__ import annotations

from torch import nn


class OpModule(nn.Module):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
