"""Setting up speculative decoding's proposer: n-gram lookups, or a draft model (found
before any weights load, so a wrong path fails at once; loaded after the target; given
a KV cache of as many blocks as the target's once warm-up has sized them)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from tessera.config import ConfigError, EngineConfig
from tessera.engine.draft_model_proposer import DraftModelProposer
from tessera.engine.model_loading import load_model
from tessera.engine.ngram_proposer import NgramProposer
from tessera.models.base import BaseRouter
from tessera.models.registry import get_router
from tessera.ops.attention.kv_quant import kv_cache_torch_dtype
from tessera.ops.registry import OpTarget
from tessera.platform import resolve_weights
from tessera.runner.graph_inputs import GraphLimits
from tessera.runner.model_runner import ModelRunner
from tessera.runner.warmup import DraftSizing
from tessera.weights.source import ModelNotFoundError

logger = logging.getLogger(__name__)

Proposer = NgramProposer | DraftModelProposer


@dataclass
class DraftModel:
    router: BaseRouter
    runner: ModelRunner | None = None  # once loaded

    @property
    def sizing(self) -> DraftSizing:
        return DraftSizing(self.runner, self.router.max_model_len)


def find_draft_model(config: EngineConfig, target_router: BaseRouter) -> DraftModel | None:
    """The draft model's router, when the config speculates with one. It is loaded like the
    target (same dtype setting and load format, its own quantization), and must share
    the target's vocabulary (a draft folder without a tokenizer is taken to share it)."""
    spec = config.speculative
    if not spec.enabled or spec.method != "draft_model":
        return None
    model_config = dataclasses.replace(config.model, model=spec.model, tokenizer=None, max_model_len=None,
                                       chat_template=None, quantization=spec.quantization)
    try:
        router = get_router(model_config)
    except (ModelNotFoundError, ValueError) as exc:
        raise ConfigError(f"speculative_config model (the draft model): {exc}") from exc
    try:
        vocab = router.tokenizer.get_vocab()
    except (OSError, ValueError) as exc:  # weights alone: as in vLLM, the target's tokenizer
        logger.warning("the draft model %s has no tokenizer that loads (%s); it is taken to share the "
                       "target's", spec.model, exc)
        return DraftModel(router)
    if vocab != target_router.tokenizer.get_vocab():
        raise ConfigError(f"the draft model {spec.model} has another vocabulary than the target: "
                          "its tokens would mean other words (a draft must share the target's tokenizer)")
    return DraftModel(router)


def load_draft_model(draft: DraftModel, config: EngineConfig, device: torch.device, show_progress: bool) -> None:
    """Build and load the draft model, unsharded on `device` (no sampler, no KV cache yet)."""
    spec = config.speculative
    router = draft.router
    dtype, quant = resolve_weights(config.model.dtype, spec.quantization, config.device,
                                   router.implementation == "native", router.stored_matrix_format)
    target = OpTarget(device.type, dtype, quant=quant,
                      kv_cache_dtype=kv_cache_torch_dtype(config.cache.kv_cache_dtype))
    model = load_model(router, target, show_progress, "draft weights")
    # its decode passes replay captured graphs too: it runs on this rank alone, joining no collective
    draft.runner = ModelRunner(model, config.cache.block_size, device, dtype, sampler=None,
                               decode_graphs=not config.model.enforce_eager)


def make_proposer(config: EngineConfig, draft: DraftModel | None, target_vocab_size: int,
                  num_blocks: int, max_model_len: int) -> Proposer | None:
    """The engine's proposer (None without speculation). A draft model's cache gets
    `num_blocks`, addressed by the target's block tables."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if draft is None:
        return NgramProposer(spec)
    draft.runner.graph_limits = GraphLimits(config.scheduler.max_num_seqs, max_model_len)
    draft.runner.allocate_kv_cache(num_blocks)
    return DraftModelProposer(spec, draft.runner, target_vocab_size, draft.router.config.vocab_size,
                              draft.router.max_model_len, config.scheduler.max_num_batched_tokens)
