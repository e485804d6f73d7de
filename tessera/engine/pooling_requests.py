"""Embedding requests in the engine: whether it pools at all (--runner), what a request may
ask of it, and the output once a prompt is pooled."""
from __future__ import annotations

import logging

import torch

from tessera.config import ConfigError, EngineConfig
from tessera.engine.request_checks import RequestError, check_prompt
from tessera.engine.sequence import Sequence, SequenceGroup
from tessera.models.base import BaseRouter
from tessera.pooling.config import PoolerConfig, classifier_config, looks_like_embedding_model, pooler_config_for
from tessera.pooling.outputs import PoolingOutput, PoolingRequestOutput
from tessera.pooling.params import PoolingParams, TokenTypedPrompt
from tessera.pooling.pooler import PoolingState
from tessera.pooling.truncation import TruncationError, truncate_ids
from tessera.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def resolve_pooler(config: EngineConfig, router: BaseRouter) -> PoolerConfig | None:
    """The pooling of an engine that serves embeddings, None for one that generates."""
    model = config.model
    name = f"{type(router).__name__} ({router.config.model_type})"
    if not router.generates or router.classifies:
        if model.runner == "generate":
            raise ConfigError(f"{name}: " + ("a sequence-classification checkpoint has no LM head to generate with"
                                             if router.classifies else "an encoder embeds text and cannot generate")
                              + " (--runner pooling)")
        if router.implementation != "native":
            raise ConfigError(f"{name}: classifiers run native types; `tessera models` lists them")
        return _pooler(config, router)
    pooling = model.runner == "pooling" or (
        model.runner == "auto" and router.implementation == "native"
        and looks_like_embedding_model(router.metadata_dir, router.config))
    if not pooling:
        if model.pooler_config:
            raise ConfigError("--pooler-config applies to embedding models (--runner pooling)")
        return None
    if router.implementation != "native":
        raise ConfigError(f"{name}: embeddings (--runner pooling) run native models; `tessera models` lists them")
    pooler = _pooler(config, router)
    if router.supports_images and pooler.task != "embed":
        raise ConfigError(f"{name}: a model that takes images pools embeddings, not classifications")
    return pooler


def _pooler(config: EngineConfig, router: BaseRouter) -> PoolerConfig:
    override = config.model.pooler_config or {}
    if config.speculative.enabled:
        raise ConfigError("a pooling model generates nothing to speculate on: drop --speculative-config")
    if config.lora.enable_lora:
        raise ConfigError("LoRA adapters are not supported for pooling models (embeddings, classifiers)")
    if router.classifies or "classifier_from_token" in override:
        if router.classifies and override:
            raise ConfigError("--pooler-config applies to embedding models and classifier_from_token, "
                              "not to a sequence-classification checkpoint")
        # --chat-template given for a classifier writes its scored pairs (vLLM's score template)
        template = router.chat_template if config.model.chat_template else None
        return classifier_config(router.config, router.default_pooling_type,
                                 _classifier_tokens(router, override) if override else None, template)
    return pooler_config_for(router.metadata_dir, router.config, config.model.pooler_config,
                             router.default_pooling_type)


def _classifier_tokens(router: BaseRouter, override: dict) -> dict[str, int]:
    """--pooler-config '{"classifier_from_token": ["no", "yes"]}': each a token of the vocabulary."""
    if set(override) != {"classifier_from_token"}:
        raise ConfigError("classifier_from_token goes alone in --pooler-config (the classifier pools the last token)")
    tokens = override["classifier_from_token"]
    if router.classifies or not router.generates:
        raise ConfigError("classifier_from_token scores with a causal LM's own logits; this model has no LM head")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    vocab = router.tokenizer.get_vocab()
    unknown = [t for t in tokens if t not in vocab]
    if unknown:
        raise ConfigError(f"classifier_from_token: {unknown} not tokens of the vocabulary (each must be one token)")
    return {t: vocab[t] for t in tokens}


def check_pooling_params(params: PoolingParams, pooler: PoolerConfig, hidden_size: int) -> None:
    dims = params.dimensions
    if dims is None:
        return
    if not pooler.is_matryoshka:
        raise RequestError("this model does not support Matryoshka dimensions: a shorter vector would not "
                           "be a useful embedding (--pooler-config '{\"is_matryoshka\": true}' allows "
                           "it for a model trained that way)", param="dimensions")
    allowed = pooler.matryoshka_dimensions
    if allowed and dims not in allowed:
        raise RequestError(f"dimensions {dims} is not one this model was trained for: {list(allowed)}",
                           param="dimensions")
    if dims > hidden_size:
        raise RequestError(f"dimensions {dims} exceeds the model's embedding size {hidden_size}",
                           param="dimensions")


def truncated_prompt(tokenizer, token_ids: list[int], params: PoolingParams, max_model_len: int,
                     token_type_ids: list[int] | None = None) -> tuple[list[int], list[int] | None]:
    """The prompt's last `truncate_prompt_tokens` tokens (-1: max_model_len of them), its
    leading and trailing special tokens kept (pooling/truncation.py), and their token types
    (a pair's: cut from the end as they are)."""
    keep = params.truncate_prompt_tokens
    if keep is None or len(token_ids) <= keep:
        return token_ids, token_type_ids
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise RequestError(f"truncate_prompt_tokens {keep} exceeds max_model_len {max_model_len}",
                           param="truncate_prompt_tokens")
    if token_type_ids is not None:
        return token_ids[-keep:], token_type_ids[-keep:]
    try:
        return truncate_ids(tokenizer, token_ids, keep), None
    except TruncationError as exc:
        raise RequestError(str(exc), param="truncate_prompt_tokens") from exc


def check_token_types(types: list[int] | None, hf_config) -> list[int] | None:
    """Segment ids the model has rows for (config.type_vocab_size; a model without that
    takes none)."""
    if types is None:
        return None
    rows = getattr(hf_config, "type_vocab_size", 0)
    bad = [t for t in types if not isinstance(t, int) or not 0 <= t < rows]
    if bad:
        raise RequestError(f"token type ids must be in [0, {rows}) for this model, got {bad[0]!r}"
                           if rows else "this model takes no token type ids")
    return types


def pooling_sequence(request_id: str, prompt: str | list[int] | TokenTypedPrompt, params: PoolingParams,
                     pooler: PoolerConfig, router: BaseRouter, max_model_len: int) -> Sequence:
    """An embedding (or classification) request's sequence, checked: its prompt tokenized,
    truncated as asked, within the context and the vocabulary, its token types (a pair's)
    ones the model has. Its sampling params are defaults nothing reads; an encoder's prompt
    attends to itself whole (`bidirectional`) and, its keys depending on later tokens, is
    never served from cached blocks."""
    types = None
    if isinstance(prompt, TokenTypedPrompt):
        prompt, types = prompt.token_ids, prompt.token_type_ids
    text = prompt if isinstance(prompt, str) else None
    token_ids = list(router.tokenizer(prompt).input_ids) if text is not None else list(prompt)
    token_ids, types = truncated_prompt(router.tokenizer, token_ids, params, max_model_len, types)
    check_prompt(token_ids, router.config.vocab_size, max_model_len, generates=False)
    check_pooling_params(params, pooler, router.config.hidden_size)
    seq = Sequence(request_id, text, token_ids, SamplingParams(), max_model_len)
    seq.pooling = PoolingState(params, every_row=pooler.needs_every_prompt_row or router.bidirectional,
                               bidirectional=router.bidirectional,
                               token_type_ids=check_token_types(types, router.config))
    seq.group = SequenceGroup(request_id, [seq])
    return seq


def pooled_output(seq: Sequence, vector: torch.Tensor, now: float) -> PoolingRequestOutput:
    metrics = {"arrival_time": seq.arrival_time, "time": now}
    if seq.first_scheduled_time is not None:
        metrics["first_scheduled_time"] = seq.first_scheduled_time
    return PoolingRequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, PoolingOutput(vector),
                                finished=True, metrics=metrics)


def wrong_kind(params: object, pooling: bool) -> RequestError | None:
    """A generation request to an embedding engine, or the other way round."""
    if pooling and not isinstance(params, PoolingParams):
        return RequestError("this engine serves an embedding model (--runner pooling): it pools prompts "
                            "into embeddings and generates no text")
    if not pooling and isinstance(params, PoolingParams):
        return RequestError("this engine serves a generative model: embeddings need an embedding model "
                            "or --runner pooling")
    return None

