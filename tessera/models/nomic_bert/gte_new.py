"""GTE folders as Alibaba publishes them (gte-base-en-v1.5, gte-large-en-v1.5,
gte-multilingual-base and its reranker): config.json of the remote-code type `new`
(Alibaba-NLP/new-impl), which transformers cannot load without that code. Its keys are
GteConfig's but for the rope, taken over here; the tensors are GTE's (gte.py).

The English v1.5 models scale their rotary by fixed NTK (`rope_scaling: {"type": "ntk",
"factor": 2.0}`): the remote code always runs the scaled frequencies (its cache is built
past the trained length at once), i.e. base * factor, each frequency then divided by
factor ** (2 / head_dim): the rotary kind "ntk" (ops/rotary.py). What the code offers and
no published folder uses is refused by name (logn attention scaling, RMS norms, unpacked
q / k / v, mixed NTK)."""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MODEL_TYPE = "new"
# the remote code's defaults, for keys a folder leaves out
DEFAULTS: dict[str, Any] = dict(
    vocab_size=30528, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", max_position_embeddings=2048, type_vocab_size=1, layer_norm_eps=1e-12, rope_theta=10000.0,
    pad_token_id=0)
# settings the remote code offers that these models never use: (key, the value served)
FIXED = (("position_embedding_type", "rope"), ("layer_norm_type", "layer_norm"), ("logn_attention_scale", False),
         ("pack_qkv", True))
ARCHITECTURES = {"NewModel": "GteModel", "NewForMaskedLM": "GteModel",
                 "NewForSequenceClassification": "GteForSequenceClassification"}
PASSED = ("id2label", "label2id", "classifier_dropout", "bos_token_id", "eos_token_id")


def gte_config_from_new(raw: dict[str, Any]) -> PretrainedConfig:
    """transformers' GteConfig for a config.json of type `new`."""
    from transformers import GteConfig

    for key, value in FIXED:
        if raw.get(key, value) != value:
            raise ValueError(f"GTE (`new`) with {key}={raw[key]!r} is not supported (served: {value!r})")
    architectures = raw.get("architectures") or ["NewModel"]
    unknown = [a for a in architectures if a not in ARCHITECTURES]
    if unknown:
        raise ValueError(f"GTE (`new`) architecture {unknown[0]} is not served ({', '.join(ARCHITECTURES)})")
    values = {key: raw.get(key, default) for key, default in DEFAULTS.items()}
    theta = float(values.pop("rope_theta"))
    config = GteConfig(**values, **{k: raw[k] for k in PASSED if k in raw},
                       architectures=[ARCHITECTURES[a] for a in architectures])
    config.rope_parameters = _rope(raw.get("rope_scaling"), theta)
    return config


def _rope(scaling: dict | None, theta: float) -> dict[str, Any]:
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta}
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "ntk" or scaling.get("mixed_b") is not None:
        raise ValueError(f"GTE (`new`) rope_scaling {scaling!r} is not supported (fixed NTK: type ntk, a factor)")
    return {"rope_type": "ntk", "rope_theta": theta, "factor": float(scaling["factor"])}
