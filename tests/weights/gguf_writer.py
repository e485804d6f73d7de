"""Writes GGUF files the way llama.cpp's convert_hf_to_gguf.py writes a Llama: llama.* (or
another architecture's) metadata, a byte-level BPE ("gpt2") vocabulary with its merges,
tensors under llama.cpp names, Q and K rows permuted into llama.cpp's interleaved rotary
layout, norms in F32 and 2-D weights in the requested type (quantized with the `gguf`
package's reference quantizers). Used by the GGUF loading tests of several model types."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

CONTEXT = 512
ROPE_THETA = 10000.0
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")

_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_PARTS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


# --- writing GGUF files the way llama.cpp does --------------------------------------------------

def llama_cpp_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GLOBAL_PARTS:
        return f"{_GLOBAL_PARTS[stem]}.{kind}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    assert m and m.group(2) in _LAYER_PARTS, hf_name
    return f"blk.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (rotate-half rows -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def round_trip(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What a loader should get back for `w` stored as `qtype`."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def storage_type(array: np.ndarray, qtype: QT) -> QT:
    return qtype if array.ndim == 2 else QT.F32  # norms (and biases) stay F32, as in llama.cpp


def rope_scaling_of(cfg) -> dict:
    """The model's rope scaling parameters (transformers 5 keeps them in rope_parameters)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", ROPE_THETA))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def llama3_rope_freqs(params: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3: per rotary frequency, 1 where the
    wavelength is short, `factor` where it is long, a smooth ramp between, computed in Python
    floats and stored as float32 (llama.cpp divides each frequency by it). The converter takes
    the original length from the config's top level (default 8192, what Llama 3.1-3.3 have);
    here it comes from the rope parameters, so tiny test models can use a short one."""
    import math

    base = params["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_len = params.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_rope_scaling(w: gguf.GGUFWriter, cfg, head_dim: int) -> dict[str, np.ndarray]:
    """Rope scaling as llama.cpp's LlamaModel writes it: linear and yarn as metadata keys,
    llama3 as the rope_freqs tensor (returned, to be added with the weights)."""
    params = rope_scaling_of(cfg)
    kind = params["rope_type"]
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    elif kind == "llama3":
        return {"rope_freqs.weight": llama3_rope_freqs(params, head_dim)}
    else:
        assert kind == "default", kind
    return {}


def tokenizer_metadata(tokenizer_json: Path, vocab_size: int, overrides: dict[int, str] | None = None) -> dict:
    """llama.cpp's gpt2 vocabulary: tokens by id (padded with [PAD{i}] user-defined tokens to
    the model's vocab size, as convert_hf_to_gguf.py pads them), types, merges "a b"."""
    data = json.loads(tokenizer_json.read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    specials = {t["id"] for t in data["added_tokens"] if t["special"]}
    for t in data["added_tokens"]:
        by_id[t["id"]] = t["content"]
    tokens, types = [], []
    by_id |= overrides or {}
    specials |= set(overrides or ())
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return dict(tokens=tokens, types=types, merges=merges)


def add_tokenizer(w: gguf.GGUFWriter, tokenizer_json: Path, vocab_size: int,
                  token_overrides: dict[int, str] | None = None, add_bos: bool = False,
                  chat_template: str = CHAT_TEMPLATE) -> None:
    """The tiny tokenizer as a llama.cpp gpt2 vocabulary, its special ids and chat template;
    `token_overrides` puts control tokens at some ids (past the tiny vocabulary's own)."""
    vocab = tokenizer_metadata(tokenizer_json, vocab_size, token_overrides)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)  # (the tiny tokenizer adds none)
    w.add_chat_template(chat_template)


def write_llama_gguf(path: Path, model: torch.nn.Module, tokenizer_json: Path, qtype: QT, *,
                     context_length: int = CONTEXT, extra_tensors: dict[str, np.ndarray] | None = None,
                     skip: tuple[str, ...] = (), arch: str = "llama",
                     extra_metadata: dict[str, str | float | int] | None = None,
                     token_overrides: dict[int, str] | None = None) -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny random llama")
    w.add_context_length(context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope_scaling_of(cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    rope_tensors = add_rope_scaling(w, cfg, head_dim)
    w.add_vocab_size(cfg.vocab_size)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size, token_overrides)
    for key, value in (extra_metadata or {}).items():
        add = w.add_string if isinstance(value, str) else w.add_uint16 if isinstance(value, int) else w.add_float32
        add(key, value)

    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes output.weight only when it is not the embedding
        name = llama_cpp_name(hf_name)
        if name in skip:
            continue
        array = tensor.detach().float().numpy()
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        stored = storage_type(array, qtype)
        data = gguf.quants.quantize(np.ascontiguousarray(array), stored)
        # F32/F16 go in as float arrays (the writer infers the type); everything else as the
        # quantizer's uint8 rows, with raw_dtype so the writer recovers the element shape.
        w.add_tensor(name, data, raw_dtype=None if stored in (QT.F32, QT.F16) else stored)
    for name, array in {**rope_tensors, **(extra_tensors or {})}.items():
        w.add_tensor(name, array.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- checkpoints ------------------------------------------------------------------------------


# --- other architectures, as convert_hf_to_gguf.py writes them ---------------------------------

# convert_hf_to_gguf.py's LlamaModel and its subclasses: Q / K permuted
LLAMA_CONVERTED = ("llama", "smollm3", "mistral3", "granite")


def _layer_parts(arch: str) -> dict[str, str]:
    """Hugging Face layer module -> llama.cpp part, for `arch` (tensor_mapping.py)."""
    parts = dict(_LAYER_PARTS)
    if arch in ("gemma2", "gemma3"):  # four norms; ffn_norm is the pre-feedforward one
        parts |= {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}
    if arch in ("qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe", "gemma3", "minimax-m2"):
        parts |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    if arch == "glm4":  # GLM-4's four norms; gate and up fused as ffn_up
        parts |= {"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",
                  "mlp.gate_up_proj": "ffn_up"}
    if arch == "olmo2":  # norms after attention and MLP only; whole-projection q / k norms
        parts |= {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm",
                  "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    if arch == "phi3":  # fused projections kept whole; gate_up_proj is written as ffn_up
        parts |= {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    parts["mlp.gate"] = "ffn_gate_inp"  # the MoE router
    return parts


def model_tensors(model: torch.nn.Module, arch: str, per_expert: bool = False,
                  fuse_gate_up: bool = False) -> dict[str, np.ndarray]:
    """The GGUF tensors convert_hf_to_gguf.py writes for `model` (float32 arrays): llama.cpp
    names; Q/K permuted for arch llama; experts stacked [E, rows, cols] as ffn_{gate,up,down}_exps
    (or, `per_expert`, one ffn_{gate,up,down}.E tensor each, as older files have them; or,
    `fuse_gate_up`, gate and up as one ffn_gate_up_exps, gate rows first); Gemma's
    norm weights with 1 added; no output tensor when the embedding is tied (always for gemma2)."""
    cfg = model.config
    parts = _layer_parts(arch)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or arch in ("gemma2", "gemma3")):
            continue
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.e_score_correction_bias", hf_name)
        if m:  # (MiniMax-M2's, beside the router) as llama.cpp names DeepSeek-style correction biases
            out[f"blk.{m.group(1)}.exp_probs_b.bias"] = array
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", hf_name)
        if m:  # transformers' fused in-memory experts: gate rows, then up rows
            layer, kind = m.groups()
            if fuse_gate_up and kind == "gate_up_proj":  # --fuse-gate-up-exps
                out[f"blk.{layer}.ffn_gate_up_exps.weight"] = array
                continue
            stacked = ({"ffn_down": array} if kind == "down_proj" else
                       {"ffn_gate": array[:, :array.shape[1] // 2], "ffn_up": array[:, array.shape[1] // 2:]})
            for part, arr in stacked.items():
                if per_expert:
                    out |= {f"blk.{layer}.{part}.{e}.weight": np.ascontiguousarray(arr[e]) for e in range(len(arr))}
                else:
                    out[f"blk.{layer}.{part}_exps.weight"] = np.ascontiguousarray(arr)
            continue
        stem, _, kind = hf_name.rpartition(".")
        if stem in _GLOBAL_PARTS:
            out[f"{_GLOBAL_PARTS[stem]}.{kind}"] = array
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
        assert m and m.group(2) in parts, hf_name
        name = f"blk.{m.group(1)}.{parts[m.group(2)]}.{kind}"
        if arch in LLAMA_CONVERTED and name.endswith(("attn_q.weight", "attn_q.bias")):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch in LLAMA_CONVERTED and name.endswith(("attn_k.weight", "attn_k.bias")):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        out[name] = array
    return out


def _model_metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    add_decoder_keys(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "gemma3":  # the global layers' rope; llama.cpp fixes the local ones at 10000
        rope = cfg.rope_parameters
        assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
        return
    theta = rope_scaling_of(cfg)["rope_theta"]
    if arch == "gemma2":  # no rope keys at all: llama.cpp's default base, 10000
        assert theta == 10000.0
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        return
    w.add_rope_freq_base(theta)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
        return
    w.add_vocab_size(cfg.vocab_size)
    if arch in LLAMA_CONVERTED:
        w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "head_dim", None):  # the generic writer: only when the config states it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def write_model_gguf(path: Path, model: torch.nn.Module, tokenizer_json: Path, arch: str,
                     qtype: QT = QT.F32, per_expert: bool = False, fuse_gate_up: bool = False,
                     add_bos: bool = False, extra_metadata=None, chat_template: str = CHAT_TEMPLATE,
                     types: dict[str, QT] | None = None) -> Path:
    """A GGUF of `model` as llama.cpp writes architecture `arch` (gemma2, phi3, qwen3moe, or
    llama for Mixtral): its metadata keys and tensors (model_tensors); 1-D tensors in F32, the
    others in `qtype` but those `types` names (llama.cpp names: a K-quant mix's wider
    matrices). `extra_metadata(writer)` adds the keys of an architecture of its own."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny random {cfg.model_type}")
    _model_metadata(w, cfg, arch)
    if extra_metadata is not None:
        extra_metadata(w)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size, add_bos=add_bos, chat_template=chat_template)
    def stored(name: str, array: np.ndarray) -> QT:
        if name in (types or {}):
            return types[name]
        return qtype if array.ndim >= 2 and not name.endswith("ffn_gate_inp.weight") else QT.F32
    write_tensors(w, ((name, array, stored(name, array))
                      for name, array in model_tensors(model, arch, per_expert, fuse_gate_up).items()))
    return path


def clip_writer(path: Path, projector_type: str, *, image_size: int, patch_size: int, width: int, ffn: int,
                blocks: int, heads: int, eps: float, projection: int, vision_projector_key: bool = False
                ) -> gguf.GGUFWriter:
    """A projector file's writer (arch clip) with the keys every convert_hf_to_gguf.py --mmproj
    writes (`vision_projector_key`: the type as clip.vision.projector_type, as Gemma 3's)."""
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_clip_has_vision_encoder(True)
    (w.add_clip_vision_projector_type if vision_projector_key else w.add_clip_projector_type)(projector_type)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch_size)
    w.add_vision_embedding_length(width)
    w.add_vision_feed_forward_length(ffn)
    w.add_vision_block_count(blocks)
    w.add_vision_head_count(heads)
    w.add_vision_attention_layernorm_eps(eps)
    w.add_vision_projection_dim(projection)
    return w


def deepseek_expert_tensors(name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """llama.cpp's tensors for a transformers DeepSeek-style experts tensor (the stacked
    gate-up and down projections, the router's correction bias), None for any other name."""
    block = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith(".mlp.experts.gate_up_proj"):  # stacked [E, 2 x width, hidden]
        half = array.shape[1] // 2
        return [(f"blk.{block}.ffn_gate_exps.weight", array[:, :half].copy()),
                (f"blk.{block}.ffn_up_exps.weight", array[:, half:].copy())]
    if name.endswith(".mlp.experts.down_proj"):
        return [(f"blk.{block}.ffn_down_exps.weight", array)]
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return [(f"blk.{block}.exp_probs_b.bias", array)]
    return None


def add_decoder_keys(w: gguf.GGUFWriter, cfg, *, blocks: int | None = None, feed_forward: int | None = None,
                     head_count_kv: int | list[int] | None = None) -> None:
    """The keys every decoder file starts with: context, widths, layers, heads. The
    keywords write what a converter writes instead of the config's own value (a layer
    count with MTP layers, per-layer KV heads, an MoE file's shared width)."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers if blocks is None else blocks)
    w.add_feed_forward_length(cfg.intermediate_size if feed_forward is None else feed_forward)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads if head_count_kv is None else head_count_kv)


def round_tripped(model: torch.nn.Module, qtype: QT, stored: Callable[[str, np.ndarray], bool]) -> torch.nn.Module:
    """`model` holding what a `qtype` file stores: the parameters `stored(name, array)` says
    the file quantizes, quantized and back (the others as they are)."""
    if qtype == QT.F32:
        return model
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            array = p.detach().float().numpy()
            if stored(name, array):
                p.copy_(torch.from_numpy(round_trip(array, qtype)))
    return ref


def fused_gate_up(tensors: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """The experts' gate and up stacks as one, gate rows first (--fuse-gate-up-exps)."""
    by_name = dict(tensors)
    out = []
    for name, array in tensors:
        if name.endswith("ffn_up_exps.weight"):
            continue
        if name.endswith("ffn_gate_exps.weight"):
            up = by_name[name.replace("ffn_gate_exps", "ffn_up_exps")]
            name, array = name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate((array, up), axis=1)
        out.append((name, array))
    return out


def write_tensors(w: gguf.GGUFWriter, tensors) -> None:
    """Add (llama.cpp name, float32 array, storage type) tensors, then write and close the file."""
    for name, array, stored in tensors:
        data = gguf.quants.quantize(np.ascontiguousarray(array), stored)
        # F32/F16 go in as float arrays (the writer infers the type); everything else as the
        # quantizer's uint8 rows, with raw_dtype so the writer recovers the element shape.
        w.add_tensor(name, data, raw_dtype=None if stored in (QT.F32, QT.F16) else stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
