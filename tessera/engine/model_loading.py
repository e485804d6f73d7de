"""Building a model from its router and loading its weights, with a progress bar: the
engine's target model, and a speculative draft model (engine/speculation.py)."""
from __future__ import annotations

import logging
import time

from torch import nn
from tqdm.auto import tqdm

from tessera.models.base import BaseRouter
from tessera.ops.registry import OpTarget

logger = logging.getLogger(__name__)


def load_model(router: BaseRouter, target: OpTarget, show_progress: bool, what: str = "weights") -> nn.Module:
    """The router's model built for `target`, its weights loaded (with a progress bar)."""
    started = time.perf_counter()
    try:
        model = router.build_model(target).eval()
    except ValueError as exc:
        if router.implementation != "native" or target.tp_size > 1:  # (sharding errors: no hint)
            raise
        # a config the native folder does not handle yet: transformers' own code may
        raise ValueError(f"{exc} (`--model-impl transformers` runs this model through transformers' "
                        "modeling code instead)") from exc
    router.load_weights(model, lambda weights: tqdm(
        weights, desc=f"Loading {what}", unit=" tensors", disable=not show_progress, leave=False))
    logger.info("loaded %s (%s, %s on %s%s) in %.1fs", router.source.name, type(model).__name__,
                target.dtype, target.device, f", {target.quant} weights" if target.quant else "",
                time.perf_counter() - started)
    return model
