"""Granite 4.0-H from llama.cpp's files: arch "granitehybrid" as its converter writes it (the
per-layer KV head counts, 0 for Mamba-2 layers; -exp(A_log) and D as [heads, 1], the gated norm
as [groups, inner / groups], the conv squeezed, dt_bias as ssm_dt.bias; Q / K permuted as
Llama's; the experts' fused gate-up split into ffn_gate_exps / ffn_up_exps and the shared MLP's
into ffn_*_shexp, or, without experts, ffn_gate / ffn_up / ffn_down; Granite's multipliers;
rotary only where rope.scaling.finetuned), read by tessera: the same greedy tokens as
transformers, F32 and Q8_0, with and without experts and rotary."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.test_granite_hybrid import make_tiny_granite_hybrid
from tests.weights.gguf_hybrids import (add_ssm_keys, assert_mamba2_vectors_back, check_equals_reference,
                                       llama_cpp_hybrid_tensor, loaded_hybrid)
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")
ARCH = "granitehybrid"


def _metadata(w: gguf.GGUFWriter, cfg) -> None:
    attention = [kind in ("attention", "full_attention") for kind in cfg.layer_types]
    feed_forward = cfg.intermediate_size if cfg.num_local_experts else cfg.shared_intermediate_size
    add_decoder_keys(w, cfg, feed_forward=feed_forward,
                     head_count_kv=[cfg.num_key_value_heads if a else 0 for a in attention])
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    if cfg.num_local_experts:
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    add_ssm_keys(w, conv_kernel=cfg.mamba_d_conv, state=cfg.mamba_d_state, groups=cfg.mamba_n_groups,
                 inner=cfg.mamba_n_heads * cfg.mamba_d_head, heads=cfg.mamba_n_heads)
    w.add_rope_scaling_finetuned(cfg.position_embedding_type == "rope")


def _tensors(hf) -> list[tuple[str, np.ndarray]]:
    cfg = hf.config
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.GRANITE_HYBRID, cfg.num_hidden_layers)
    experts = bool(cfg.num_local_experts)
    out = []
    for name, tensor in hf.state_dict().items():
        t = tensor.detach().float()
        block = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("block_sparse_moe.router.weight"):
            out.append((f"blk.{block}.ffn_gate_inp.weight", t.numpy()))
            continue
        if name.endswith("block_sparse_moe.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up
            gate, up = t.split(t.shape[1] // 2, dim=1)
            out += [(f"blk.{block}.ffn_gate_exps.weight", gate.contiguous().numpy()),
                    (f"blk.{block}.ffn_up_exps.weight", up.contiguous().numpy())]
            continue
        if name.endswith("block_sparse_moe.experts.down_proj"):
            out.append((f"blk.{block}.ffn_down_exps.weight", t.numpy()))
            continue
        if name.endswith(("input_linear.weight", "output_linear.weight")):
            shared = ".shared_mlp." in name
            if name.endswith("output_linear.weight"):
                part = "ffn_down_shexp" if shared and experts else "ffn_down" if shared else "ffn_down_exps"
                out.append((f"blk.{block}.{part}.weight", t.numpy()))
                continue
            gate, up = t.split(t.shape[-2] // 2, dim=-2)
            suffix = ("_shexp" if experts else "") if shared else "_exps"
            out += [(f"blk.{block}.ffn_gate{suffix}.weight", gate.contiguous().numpy()),
                    (f"blk.{block}.ffn_up{suffix}.weight", up.contiguous().numpy())]
            continue
        t = llama_cpp_hybrid_tensor(name, t, cfg, cfg.mamba_n_groups)
        lookup = name.replace("mamba.dt_bias", "mamba.dt_proj.bias")
        gguf_name = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out.append((gguf_name, np.ascontiguousarray(t.numpy())))
    return out


def _quantized(name: str, array: np.ndarray) -> bool:
    return (array.ndim >= 2 and array.shape[-1] % 32 == 0 and "conv1d" not in name and "ffn_gate_inp" not in name
            and "router" not in name and "ssm_norm" not in name and "mamba.norm" not in name)


def write_granitehybrid_gguf(path: Path, hf, tokenizer_json: Path, qtype: QT) -> Path:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny random granite 4.0-h")
    _metadata(w, hf.config)
    add_tokenizer(w, tokenizer_json, hf.config.vocab_size)
    write_tensors(w, ((n, a, qtype if _quantized(n, a) else QT.F32) for n, a in _tensors(hf)))
    return path


@pytest.mark.parametrize("case, qtype", [("granite-4.0-h-moe-nope", QT.F32), ("granite-4.0-h-moe-nope", QT.Q8_0),
                                         ("granite-hybrid-dense-rope", QT.F32)])
def test_granitehybrid_gguf_equals_transformers(case, qtype, tmp_path, tiny_tokenizer_dir, monkeypatch):
    hf = make_tiny_granite_hybrid(case, tmp_path / "hf", tiny_tokenizer_dir, seed=3)
    path = write_granitehybrid_gguf(tmp_path / "granite.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    with loaded_hybrid(path, tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == "granitemoehybrid"
        assert config.position_embedding_type == hf.config.position_embedding_type
        assert_mamba2_vectors_back(llm.engine.runner.model.model.layers[0].mamba, hf.model.layers[0].mamba)
        check_equals_reference(llm, hf, qtype, _quantized, f"granitehybrid-{case}", monkeypatch)


def test_partial_rotary_files_are_refused_by_name(tmp_path, tiny_tokenizer_dir):
    """Bamba's files (the same arch, rotary over part of each head) are not read as Granite's."""
    hf = make_tiny_granite_hybrid("granite-hybrid-dense-rope", tmp_path / "hf", tiny_tokenizer_dir, seed=3)
    path = tmp_path / "bamba.gguf"
    w = gguf.GGUFWriter(str(path), ARCH)
    _metadata(w, hf.config)
    w.add_rope_dimension_count(8)
    add_tokenizer(w, Path(tiny_tokenizer_dir) / "tokenizer.json", hf.config.vocab_size)
    write_tensors(w, ((n, a, QT.F32) for n, a in _tensors(hf)))
    with pytest.raises(ValueError, match="Bamba"):
        LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache")
