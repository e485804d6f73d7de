"""NomicBERT as nomic-ai publishes it: a config in GPT-2's key names (n_embd, n_layer,
rotary_emb_base, ...) for its remote code, and tensors named by that code (encoder.layers.N.
attn.Wqkv, mlp.fc11 / fc12 / fc2, norm1 / norm2, emb_ln). transformers' NomicBertConfig
reads none of those keys (its defaults happen to be nomic-embed-text-v1.5's), so the keys
are taken over here, and what the code could do beyond v1 / v1.5 is refused by name."""
from __future__ import annotations

import re

from transformers import PretrainedConfig

from tessera.models.nomic_bert.modeling import RotaryEncoderForClassification, RotaryEncoderForEmbedding

# the remote code's config key -> transformers' name
KEYS = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
        "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps",
        "max_trained_positions": "max_position_embeddings"}
# settings the remote code offers that these models never use: (key, the value served)
FIXED = (("prenorm", False), ("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False),
         ("use_rms_norm", False), ("qkv_proj_bias", False), ("mlp_fc1_bias", False), ("mlp_fc2_bias", False),
         ("parallel_block", False), ("rotary_scaling_factor", None), ("moe_every_n_layers", 0))
ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}


def take_remote_code_keys(config: PretrainedConfig) -> PretrainedConfig:
    """`config` with the remote code's keys (where present) as transformers' attributes."""
    if not hasattr(config, "n_embd"):
        return config
    for key, value in FIXED:
        given = getattr(config, key, value)
        if given != value and not (value == 0 and given is None):
            raise ValueError(f"nomic_bert with {key}={given!r} is not supported (served: {value!r})")
    for key, name in KEYS.items():
        if getattr(config, key, None) is not None:
            setattr(config, name, getattr(config, key))
    if config.intermediate_size is None:
        config.intermediate_size = 4 * config.hidden_size
    activation = getattr(config, "activation_function", "swiglu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"nomic_bert activation_function {activation!r} is not supported ({', '.join(ACTIVATIONS)})")
    config.hidden_act = ACTIVATIONS[activation]
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.rope_parameters = {"rope_type": "default", "rope_theta": float(getattr(config, "rotary_emb_base", 10000))}
    return config


# the remote code's tensor names -> transformers' (then packed as transformers' are)
RENAMES = ((r"^encoder\.layers\.", "layers."), (r"^emb_ln\.", "embeddings.LayerNorm."),
           (r"\.attn\.Wqkv\.", ".self_attn.qkv_proj."), (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
           (r"\.mlp\.fc2\.", ".mlp.down_proj."), (r"\.norm1\.", ".post_attention_layernorm."),
           (r"\.norm2\.", ".post_mlp_layernorm."))
GATED = {"fc11": 1, "fc12": 0}  # fc11 is the up projection, fc12 the gate (SiLU'd)


def remote_code_name(name: str) -> tuple[str, int | None] | None:
    """(our name, shard) for a tensor named by the remote code (after the model's prefix
    rules), None for any other name."""
    part = name.removeprefix("model.")
    renamed = part
    for pattern, replacement in RENAMES:
        renamed = re.sub(pattern, replacement, renamed)
    gated = re.search(r"\.mlp\.(fc11|fc12)\.", renamed)
    if gated is not None:
        return "model." + renamed.replace(gated.group(0), ".mlp.gate_up_proj."), GATED[gated.group(1)]
    return ("model." + renamed, None) if renamed != part else None


class NomicBertForEmbedding(RotaryEncoderForEmbedding):
    base_prefixes = ("nomic_bert.",)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, int | None] | None:
        return remote_code_name(name)


class NomicBertForClassification(RotaryEncoderForClassification):
    base_prefixes = ("nomic_bert.",)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, int | None] | None:
        return remote_code_name(name)
