"""Building a model from its router and loading its weights, with a progress bar: the
engine's target model, and a speculative draft model (engine/speculation.py)."""
from __future__ import annotations

import logging
import time

from torch import nn
from tqdm.auto import tqdm

from tessera.models.base import BaseRouter
from tessera.ops.registry import OpTarget
from tessera.pooling.config import PoolerConfig
from tessera.pooling.model import as_pooling_model

logger = logging.getLogger(__name__)


def load_model(router: BaseRouter, target: OpTarget, show_progress: bool, what: str = "weights",
               pooling: PoolerConfig | None = None) -> nn.Module:
    """The router's model built for `target`, its weights loaded (with a progress bar);
    `pooling`: as an embedding model or classifier (pooling/model.py)."""
    started = time.perf_counter()
    try:
        model = router.build_model(target).eval()
        if pooling is not None:
            model = as_pooling_model(model, pooling, target)
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
    if target.quant:
        _note_unquantized(model, target)
    else:
        _note_stored_format(router, target)
    return model


def _note_stored_format(router: BaseRouter, target: OpTarget) -> None:
    """A GGUF's matrices loaded dequantized to the model dtype: say which --quantization
    would keep them near the file's own size (and decode faster where bytes bound it)."""
    stored = router.stored_matrix_format or ""
    kept = "int4" if stored.startswith(("Q4", "IQ4")) else "int8" if stored.startswith(("Q8", "Q5", "Q6")) else None
    if kept:
        logger.info("the GGUF stores its weight matrices as %s; they loaded dequantized to %s "
                    "(--quantization %s keeps them compact: less memory, faster decode on CPU)",
                    stored, str(target.dtype).removeprefix("torch."), kept)


def _note_unquantized(model: nn.Module, target: OpTarget) -> None:
    """Say which linear layers and expert stacks --quantization left in the model dtype
    (shapes the format does not take, experts no builder takes quantized there), so a model
    it barely touches is not mistaken for a quantized one."""
    from tessera.ops.embedding import LMHead
    from tessera.ops.linear import Linear
    from tessera.ops.moe import ExpertStacks

    layers = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
    kept = [m for m in layers if m.weight.is_floating_point()]
    if kept:
        logger.warning("--quantization %s: %d of %d linear layers keep their %s weights (shapes the "
                       "format or its kernel does not take)", target.quant, len(kept), len(layers), target.dtype)
    stacks = [w for m in model.modules() if isinstance(m, ExpertStacks) for w in m.stacks()]
    kept = [w for w in stacks if w.is_floating_point()]
    if kept:
        logger.warning("--quantization %s: %d of %d MoE expert stacks keep their %s weights", target.quant,
                       len(kept), len(stacks), target.dtype)
