"""Settings the engine refuses before building anything, with the reason: combinations
that cannot run together, and features the model type's router does not support."""
from __future__ import annotations

import logging

from tessera.config import ConfigError, EngineConfig, async_scheduling_conflict
from tessera.models.base import BaseRouter
from tessera.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def check_engine_config(config: EngineConfig, router: BaseRouter, max_model_len: int) -> None:
    sched, tp = config.scheduler, config.parallel.tensor_parallel_size
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) "
            f"must be >= max_model_len ({max_model_len})")
    if sched.async_scheduling:
        reason = async_scheduling_conflict(config.speculative.enabled, tp)
        if reason is not None:
            raise ConfigError(reason)
    try:
        if router.implementation == "native":
            router.checkpoint_quantization  # a format we cannot read fails here, before any loading
        if config.model.chat_template:
            router.chat_template  # a --chat-template path that does not exist, too
        router.sampling_defaults  # and generation_config.json sampling values no request could use
        if config.model.mm_processor_kwargs and router.supports_images:
            router.image_prompts  # image processor settings it does not take
    except ValueError as exc:  # QuantizedCheckpointError among them
        raise ConfigError(str(exc)) from exc
    features = type(router).features()
    name = f"{type(router).__name__} ({router.config.model_type})"
    if config.model.mm_processor_kwargs and not router.supports_images:
        raise ConfigError(f"{name} takes no images: --mm-processor-kwargs has no image processor to set")
    if config.lora.enable_lora and not features["supports_lora"]:
        raise ConfigError(f"{name} does not support LoRA adapters; `tessera models` lists the types that do")
    if config.speculative.enabled and config.speculative.method == "draft_model" and router.supports_images:
        raise ConfigError(f"{name}: a draft model would not see the images; n-gram speculation works "
                          "with images")
    if tp > 1 and not features["supports_tensor_parallel"]:
        raise ConfigError(f"{name} does not support tensor parallelism; `tessera models` lists the types that do")


def check_recurrent_model(config: EngineConfig, runner: ModelRunner) -> None:
    """A model with recurrent layers (linear attention) keeps one state per sequence, which
    only moves forward: a draft token rejected after it was written cannot be taken back,
    so speculative decoding is refused. (Prefix caching keeps snapshots of the state at
    block boundaries: engine/state_cache.py.)"""
    if not runner.state_layers:
        return
    if config.speculative.enabled:
        raise ConfigError(f"{type(runner.model).__name__} has recurrent (linear attention) layers, whose state "
                          "cannot roll back rejected draft tokens: speculative decoding is not supported for it")
    seqs = config.scheduler.max_num_seqs
    logger.info("recurrent state: %d slots (%d running sequences%s), %.1f MiB", runner.num_state_slots, seqs,
                f", {runner.num_state_slots - seqs} prefix-cache snapshots" if runner.num_state_slots > seqs else "",
                runner.num_state_slots * runner.state_bytes_per_sequence() / 2**20)
