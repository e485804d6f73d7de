"""Whether a checkpoint is served as an embedding model, and how it pools.

A sentence-transformers folder says so itself: modules.json lists a Pooling module (its
1_Pooling/config.json names the pooling mode) and, when the vectors are unit length, a
Normalize module. A checkpoint saved as the bare backbone (architectures "Qwen3Model",
"MistralModel", ...) has no LM head to generate with. Either makes `--runner auto` pool;
`--runner pooling` pools any text model (the last token's hidden state, normalized, where
nothing says otherwise: what decoder embedding models use), and `--pooler-config` overrides
the pooling type and normalization, as vLLM's does.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PretrainedConfig

from tessera.config import ConfigError

logger = logging.getLogger(__name__)

# LAST: the last prompt token's hidden state (decoder embedders: Qwen3-Embedding, e5-mistral,
# gte-Qwen2); MEAN: the average over the prompt; CLS: the first token's
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json flags -> our pooling type
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                               "pooling_mode_cls_token": "CLS"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")
ST_MODULE = "sentence_transformers.models."
OVERRIDE_KEYS = ("pooling_type", "normalize", "is_matryoshka", "classifier_from_token")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    # whether a request may ask for fewer `dimensions` (a Matryoshka-trained model: its
    # leading components are an embedding of their own); which sizes, when the config lists them
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # config_sentence_transformers.json's named prompts ({"query": "Instruct: ...\nQuery:"}):
    # TEI's `prompt_name` puts one before a text
    prompts: dict[str, str] = field(default_factory=dict, compare=False)
    # "embed": the pooled vector is the output; "classify": the model's classification head
    # turns it into `labels` logits (a cross-encoder reranker: one, its relevance score)
    task: str = "embed"
    labels: tuple[str, ...] = ()
    # a one-label classifier's score: "sigmoid" (sentence-transformers' CrossEncoder
    # default) or "identity" (the raw logit, where the checkpoint says so)
    score_activation: str = "sigmoid"
    # a causal LM classifying from tokens' logits (Qwen3-Reranker's "no", "yes"); empty: a head
    classifier_token_ids: tuple[int, ...] = ()
    # a pair's second text has its own segment id (BERT's token types; decoders have none)
    pair_segments: bool = False
    # a chat template that writes a scored pair (--chat-template for a classifier: vLLM's
    # score template, e.g. Qwen3-Reranker's instruction); None: the tokenizer's pair encoding
    pair_template: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether every prompt position's hidden state is read (so no cached prefix is reused)."""
        return self.pooling_type != "LAST"


def classifier_config(hf_config: PretrainedConfig, pooling_type: str,
                      from_tokens: dict[str, int] | None = None, pair_template: str | None = None) -> PoolerConfig:
    """A *ForSequenceClassification checkpoint: its head reads the `pooling_type` row. With
    `from_tokens` (token -> id), a causal LM's logits at those tokens are the labels (two: one
    label, the second's logit minus the first's). `pair_template`: a chat template that
    writes each scored pair (PoolerConfig.pair_template)."""
    labels = getattr(hf_config, "id2label", None) or {0: "LABEL_0"}
    names = tuple(str(labels[i]) for i in sorted(labels, key=int))
    if from_tokens:
        names = ("score",) if len(from_tokens) == 2 else tuple(from_tokens)
    # sentence-transformers' CrossEncoder records its activation in config.json (older and
    # newer key); transformers' plain classifiers leave it out: sigmoid for one label
    st = getattr(hf_config, "sentence_transformers", None)
    activation = (st.get("activation_fn") if isinstance(st, dict) else None) or getattr(
        hf_config, "sbert_ce_default_activation_function", None) or "Sigmoid"
    kind = str(activation).rsplit(".", 1)[-1]
    if kind not in ("Sigmoid", "Identity"):
        raise ConfigError(f"the cross-encoder activation {activation!r} is not supported (Sigmoid, Identity)")
    config = PoolerConfig(pooling_type, normalize=False, task="classify", labels=names,
                          score_activation=kind.lower(), classifier_token_ids=tuple((from_tokens or {}).values()),
                          pair_segments=bool(getattr(hf_config, "type_vocab_size", 0)) and pair_template is None,
                          pair_template=pair_template)
    logger.info("serving a classifier: %d label%s from the %s row%s", len(names), "s" * (len(names) > 1),
                pooling_type, f", scores through {kind.lower()}" if len(names) == 1 else "")
    return config


def looks_like_embedding_model(metadata_dir: Path, hf_config: PretrainedConfig) -> bool:
    """What `--runner auto` pools: a sentence-transformers folder, or a bare backbone."""
    if _sentence_transformers_modules(metadata_dir):
        return True
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(architectures) and all(a.endswith("Model") for a in architectures)


def pooler_config_for(metadata_dir: Path, hf_config: PretrainedConfig,
                      override: dict | None = None, default_type: str = "LAST") -> PoolerConfig:
    """The folder's pooling (sentence-transformers files, else `default_type`, normalized:
    LAST for decoders, CLS for encoders), with `override` (--pooler-config) applied over it."""
    settings: dict = {"pooling_type": default_type, "normalize": True}
    modules = _sentence_transformers_modules(metadata_dir)
    if modules:
        settings.update(_from_sentence_transformers(metadata_dir, modules))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    settings["is_matryoshka"] = bool(getattr(hf_config, "is_matryoshka", False) or dims)
    if dims:
        settings["matryoshka_dimensions"] = tuple(int(d) for d in dims)
    if override:
        unknown = sorted(set(override) - set(OVERRIDE_KEYS))
        if unknown:
            raise ConfigError(f"unknown --pooler-config keys {unknown}; known: {list(OVERRIDE_KEYS)}")
        for key in ("normalize", "is_matryoshka"):
            if key in override and not isinstance(override[key], bool):
                raise ConfigError(f"--pooler-config {key} must be true or false, got {override[key]!r}")
        if "pooling_type" in override:
            value = override["pooling_type"]
            settings["pooling_type"] = value.upper() if isinstance(value, str) else value
        settings.update({k: override[k] for k in ("normalize", "is_matryoshka") if k in override})
    config = PoolerConfig(**settings, prompts=_named_prompts(Path(metadata_dir)))
    logger.info("serving embeddings: %s pooling%s%s%s", config.pooling_type,
                ", normalized" if config.normalize else "", " (sentence-transformers modules)" if modules else "",
                ", Matryoshka dimensions" if config.is_matryoshka else "")
    return config


def _named_prompts(metadata_dir: Path) -> dict[str, str]:
    path = metadata_dir / "config_sentence_transformers.json"
    if not path.is_file():
        return {}
    try:
        prompts = json.loads(path.read_text()).get("prompts") or {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"{path} is not a JSON object: {exc}") from exc
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ConfigError(f"{path}: `prompts` should map names to texts")
    return prompts


def _sentence_transformers_modules(metadata_dir: Path) -> list[dict]:
    path = Path(metadata_dir) / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{path} should list sentence-transformers modules")
    return modules


def _from_sentence_transformers(metadata_dir: Path, modules: list[dict]) -> dict:
    """The pooling type and normalization its modules set; modules that change the vector
    in ways we do not compute (Dense projections, ...) are refused by name."""
    settings: dict = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(ST_MODULE)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            settings["normalize"] = True
        elif kind == "Pooling":
            settings["pooling_type"] = _pooling_mode(Path(metadata_dir) / str(module.get("path", "")) / "config.json")
        else:
            raise ConfigError(f"the sentence-transformers module {module.get('type')!r} ({module.get('path')}) "
                              "is not supported: tessera computes Transformer, Pooling and Normalize modules")
    return settings


def _pooling_mode(path: Path) -> str:
    if not path.is_file():
        raise ConfigError(f"modules.json lists a Pooling module but {path} is missing")
    flags = json.loads(path.read_text())
    unsupported = [m for m in UNSUPPORTED_MODES if flags.get(m)]
    if unsupported:
        raise ConfigError(f"{path}: {unsupported[0]} is not supported (tessera pools by "
                          f"{', '.join(SENTENCE_TRANSFORMERS_MODES)})")
    modes = [kind for flag, kind in SENTENCE_TRANSFORMERS_MODES.items() if flags.get(flag)]
    if len(modes) != 1:
        raise ConfigError(f"{path}: exactly one pooling mode must be set, got {modes or 'none'}")
    return modes[0]
