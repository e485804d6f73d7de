"""Writes a Gemma 4 GGUF the way llama.cpp's converter does (conversion/gemma.py, Gemma4Model on
Gemma3Model): arch "gemma4"; key_length the full layers' head size and key_length_swa the
sliding ones'; the sliding-window pattern as one flag per layer (true: sliding); head_count_kv
and feed_forward_length per layer where they differ (a global KV head count, double-wide
shared layers); shared_kv_layers and embedding_length_per_layer_input; the global layers' rope
base (and the local one's); plain norm weights (no 1 + w); tensors under the names gguf's
TensorNameMap gives, router.scale as ffn_gate_inp.scale and per_expert_scale as
ffn_down_exps.scale, the layer scalar as layer_output_scale.weight; and rope_freqs, the full
layers' proportional rope as frequency divisors (1 for the turned pairs, 1e30 for the rest)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tests.weights.gguf_writer import add_tokenizer, write_tensors


def gguf_name(hf_name: str, names: gguf.TensorNameMap) -> str:
    """llama.cpp's name for one of the checkpoint's tensors."""
    for scale, part in ((".router.scale", ".ffn_gate_inp.scale"), (".router.per_expert_scale", ".ffn_down_exps.scale")):
        if hf_name.endswith(scale):
            return hf_name.replace("model.layers.", "blk.").replace(scale, part)
    if hf_name.endswith("layer_scalar") or (".experts." in hf_name and not hf_name.endswith(".weight")):
        hf_name += ".weight"
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_name
    return name


def gemma4_tensors(model: torch.nn.Module) -> dict[str, tuple[str, np.ndarray]]:
    """{checkpoint name: (llama.cpp name, float32 array)}, and rope_freqs."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_hidden_layers)
    out = {hf_name: (gguf_name(hf_name, names), tensor.detach().float().numpy().copy())
           for hf_name, tensor in model.state_dict().items()
           if not (hf_name == "lm_head.weight" and cfg.tie_word_embeddings)}
    full_head = cfg.per_layer_config["full_attention"].head_dim
    turned = int(full_head * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    out["rope_freqs"] = ("rope_freqs.weight",
                         np.array([1.0] * turned + [1e30] * (full_head // 2 - turned), np.float32))
    return out


def _metadata(w: gguf.GGUFWriter, cfg) -> None:
    sliding = [kind == "sliding_attention" for kind in cfg.layer_types]
    # each layer type's head size and KV heads (the config refuses to say one for all)
    full, local = cfg.per_layer_config["full_attention"], cfg.per_layer_config["sliding_attention"]
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(local.head_dim)
    w.add_value_length_swa(local.head_dim)
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    if cfg.use_double_wide_mlp:
        w.add_feed_forward_length([cfg.intermediate_size * (2 if i >= first_shared else 1)
                                   for i in range(cfg.num_hidden_layers)])
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    if full.num_key_value_heads != local.num_key_value_heads:
        w.add_head_count_kv([local.num_key_value_heads if s else full.num_key_value_heads for s in sliding])
    else:
        w.add_head_count_kv(local.num_key_value_heads)
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(local.head_dim)
    if cfg.enable_moe_block:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def stored_type(name: str, shape: tuple[int, ...], qtype: QT) -> QT:
    """F32 for vectors, the router and rows a quant block does not divide (llama.cpp's
    fallback), else `qtype`."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if len(shape) < 2 or name.endswith("ffn_gate_inp.weight") or shape[-1] % block:
        return QT.F32
    return qtype


def write_gemma4_gguf(path: Path, model: torch.nn.Module, tokenizer_json: Path, qtype: QT = QT.F32,
                      token_overrides: dict[int, str] | None = None, add_bos: bool = False) -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("tiny random gemma4")
    _metadata(w, cfg)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size, token_overrides, add_bos=add_bos)
    write_tensors(w, ((name, array, stored_type(name, array.shape, qtype))
                      for name, array in gemma4_tensors(model).values()))
    return path
