"""Config fields transformers' GGUF conversion leaves out or gets wrong for the model types
tessera serves natively, filled in from the file as llama.cpp reads it:

- biases (no metadata key: the tensors say) and head_dim (`attention.key_length`);
- rope scaling (gguf_rope.py);
- Gemma 2 and 3: the soft-caps from their keys, and the query scale llama.cpp uses (the file
  has no query_pre_attn_scalar: head_dim, or hidden / heads for the 27B models, which
  llama.cpp knows by their layer count);
- Mixtral: llama.cpp writes it as arch "llama" with `expert_count`, which transformers turns
  into a dense LlamaConfig; it becomes a MixtralConfig;
- Phi-3: its original context length and sliding window (0: none);
- gpt-oss: YaRN untruncated, and MXFP4 experts marked as such (they stay packed);
- Qwen3-MoE: the experts' width (`expert_feed_forward_length`) and renormalised top-k
  weights (llama.cpp always renormalises for qwen3moe; the file never says).
"""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_mxfp4 import MXFP4
from tessera.weights.gguf_rope import apply_gguf_rope, field_value as _field

# how llama.cpp recognises the 27B models, whose query scale is hidden / heads
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _set_bias_flags(config: Any, names: set[str]) -> None:
    """GGUF metadata has no bias flags; the tensors say whether the checkpoint has biases."""
    if any(n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")) for n in names):
        config.attention_bias = True
    if any(n.endswith(("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")) for n in names):
        config.mlp_bias = True


def _set_head_dim(config: Any, fields: dict, arch: str) -> None:
    """transformers' conversion does not read `<arch>.attention.key_length` for every type;
    models whose head_dim is not hidden_size / heads (Qwen3) need it."""
    key = _field(fields, f"{arch}.attention.key_length")
    if key is not None:
        config.head_dim = int(key)


def _gemma(config: Any, fields: dict, arch: str) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _field(fields, f"{arch}.{name}")
        if value is not None:
            setattr(config, name, float(value))
    if config.num_hidden_layers == GEMMA_27B_LAYERS[arch]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def _mixtral(config: Any, experts: int, used: int) -> Any:
    from transformers import MixtralConfig

    kept = {k: v for k, v in config.to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version")}
    return MixtralConfig(**kept, num_local_experts=experts, num_experts_per_tok=used,
                         sliding_window=None, architectures=["MixtralForCausalLM"])


def _gpt_oss(config: Any, tensors: list) -> None:
    """gpt-oss: YaRN without truncating its correction range, as the released configs say
    (the file has no key for it); MXFP4 experts kept packed, as from OpenAI's checkpoints."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type") == "yarn":
        config.rope_parameters = {**params, "truncate": False}
    experts = [t for t in tensors if t.name.endswith("_exps.weight")]
    if experts and all(int(t.tensor_type) == MXFP4 for t in experts):  # (mixed types: all dequantized)
        config.quantization_config = {"quant_method": "mxfp4"}


def complete_gguf_config(config: Any, fields: dict, tensors: list) -> Any:
    """`config` (transformers' conversion of the file) completed from the file's `fields`
    and `tensors` (a gguf.GGUFReader's); may be a new config object (Mixtral)."""
    arch = _field(fields, "general.architecture")
    _set_bias_flags(config, {t.name for t in tensors})
    if arch is None:
        return config
    _set_head_dim(config, fields, arch)
    apply_gguf_rope(config, fields, tensors)
    if arch in GEMMA_27B_LAYERS:
        _gemma(config, fields, arch)
    elif arch == "phi3":
        original = _field(fields, "phi3.rope.scaling.original_context_length")
        if original is not None:
            config.original_max_position_embeddings = int(original)
        config.sliding_window = _field(fields, "phi3.attention.sliding_window") or None
    elif arch == "qwen3moe":
        width = _field(fields, "qwen3moe.expert_feed_forward_length")
        if width is not None:
            config.moe_intermediate_size = int(width)
        config.norm_topk_prob = True  # transformers' conversion says so too, today
    elif arch == "gpt-oss":
        _gpt_oss(config, tensors)
    elif arch == "llama" and (_field(fields, "llama.expert_count") or 0) > 0:
        config = _mixtral(config, int(_field(fields, "llama.expert_count")),
                          int(_field(fields, "llama.expert_used_count")))
    return config
