"""Falcon-H1 from llama.cpp's files: arch "falcon-h1" as its converter writes it, every muP
multiplier folded into the weights (so the file's model has none), the Mamba-2 tensors as
Granite 4.0-H's files keep them, Q / K permuted as Llama's; read by tessera: the same logits
and greedy tokens as transformers' model of the folded weights (itself checked against the
original), F32 and Q8_0; a file with the mixer's norm is refused."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tessera.weights.gguf_falcon_h1 import ARCH, FOLDED
from tests.models.parity import hf_logits
from tests.models.test_falcon_h1 import make_tiny_falcon_h1
from tests.weights.gguf_hybrids import (add_ssm_keys, assert_mamba2_vectors_back, check_equals_reference,
                                       llama_cpp_hybrid_tensor, loaded_hybrid)
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")


def folded(hf) -> torch.nn.Module:
    """transformers' Falcon-H1 with the converter's fold: each multiplier into its weights,
    the config's multipliers 1."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = hf.config
    inner, bc, parts = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state, cfg.ssm_multipliers
    scales = {"feed_forward.down_proj.weight": cfg.mlp_multipliers[1], "feed_forward.gate_proj.weight":
              cfg.mlp_multipliers[0], "self_attn.k_proj.weight": cfg.key_multiplier * cfg.attention_in_multiplier,
              "self_attn.q_proj.weight": cfg.attention_in_multiplier, "self_attn.v_proj.weight":
              cfg.attention_in_multiplier, "self_attn.o_proj.weight": cfg.attention_out_multiplier,
              "mamba.out_proj.weight": cfg.ssm_out_multiplier, "lm_head.weight": cfg.lm_head_multiplier,
              "model.embed_tokens.weight": cfg.embedding_multiplier}
    state = {}
    for name, tensor in hf.state_dict().items():
        t = tensor.detach().float().clone()
        scale = next((v for k, v in scales.items() if name.endswith(k)), None)
        if scale is not None:
            t *= scale
        elif name.endswith("mamba.in_proj.weight"):  # [z | x | B | C | dt] rows, each part its multiplier
            t *= cfg.ssm_in_multiplier
            bounds = [0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc, t.shape[0]]
            for i, m in enumerate(parts):
                t[bounds[i]:bounds[i + 1]] *= m
        state[name] = t
    model = FalconH1ForCausalLM(FalconH1Config(**{**cfg.to_dict(), **FOLDED})).eval()
    model.load_state_dict(state, strict=False)
    return model


def _metadata(w: gguf.GGUFWriter, cfg) -> None:
    add_decoder_keys(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    add_ssm_keys(w, conv_kernel=cfg.mamba_d_conv, state=cfg.mamba_d_state, groups=cfg.mamba_n_groups,
                 inner=cfg.mamba_d_ssm, heads=cfg.mamba_n_heads)


def _tensors(model) -> list[tuple[str, np.ndarray]]:
    cfg = model.config
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.FALCON_H1, cfg.num_hidden_layers)
    out = []
    for name, tensor in model.state_dict().items():
        t = llama_cpp_hybrid_tensor(name, tensor.detach().float(), cfg, cfg.mamba_n_groups)
        lookup = name.replace("mamba.dt_bias", "mamba.dt_proj.bias")
        stem, kind = lookup.rsplit(".", 1) if lookup.endswith((".weight", ".bias")) else (lookup, None)
        gguf_name = table.get_name(stem)
        if gguf_name is None:  # (gguf's map keys a few of Falcon-H1's names with their suffix)
            gguf_name = table.get_name(lookup)
        assert gguf_name is not None, name
        out.append((gguf_name if kind is None else f"{gguf_name}.{kind}", np.ascontiguousarray(t.numpy())))
    return out


def _quantized(name: str, array: np.ndarray) -> bool:
    return array.ndim == 2 and array.shape[-1] % 32 == 0 and "conv1d" not in name and "norm" not in name


def write_falcon_h1_gguf(path: Path, model, tokenizer_json: Path, qtype: QT) -> Path:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny random falcon-h1")
    _metadata(w, model.config)
    add_tokenizer(w, tokenizer_json, model.config.vocab_size)
    write_tensors(w, ((n, a, qtype if _quantized(n, a) else QT.F32) for n, a in _tensors(model)))
    return path


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_falcon_h1_gguf_equals_transformers(qtype, tmp_path, tiny_tokenizer_dir, monkeypatch):
    hf = make_tiny_falcon_h1("falcon-h1-gate-only", tmp_path / "hf", tiny_tokenizer_dir, seed=3)
    reference = folded(hf)
    ids = [5, 9, 17, 33, 60, 7, 81]  # (the fold is the same model)
    torch.testing.assert_close(hf_logits(reference, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    path = write_falcon_h1_gguf(tmp_path / "falcon.gguf", reference, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    with loaded_hybrid(path, tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == "falcon_h1" and config.key_multiplier == 1.0 and config.mlp_multipliers == [1, 1]
        assert_mamba2_vectors_back(llm.engine.runner.model.model.layers[0].mamba, hf.model.layers[0].mamba)
        check_equals_reference(llm, reference, qtype, _quantized, f"falcon-h1-gguf-{qtype.name}", monkeypatch)


def test_a_mixer_norm_is_refused(tmp_path, tiny_tokenizer_dir):
    hf = make_tiny_falcon_h1("falcon-h1-norm-then-gate", tmp_path / "hf", tiny_tokenizer_dir, seed=3)
    path = write_falcon_h1_gguf(tmp_path / "falcon.gguf", folded(hf), Path(tiny_tokenizer_dir) / "tokenizer.json",
                                QT.F32)
    with pytest.raises(ValueError, match="mixer's RMSNorm"):
        LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache")
