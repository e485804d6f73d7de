"""ERNIE 4.5 from llama.cpp's files: arch "ernie4_5" (the dense 0.3B) and "ernie4_5-moe" as its
converter writes them (Q / K unpermuted: the rotary is interleaved in both; the experts
stacked as ffn_*_exps, the shared ones as ffn_*_shexp, the correction bias as exp_probs_b;
the MoE layers from leading_dense_block_count every interleave_moe_layer_step-th, to the last
block with experts), read by tessera: the same greedy tokens as transformers, F32 and Q8_0."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_alone_and_batched
from tests.models.test_ernie4_5 import CASES, make_tiny_ernie
from tests.weights.gguf_writer import (add_decoder_keys, add_tokenizer, deepseek_expert_tensors, fused_gate_up,
                                       round_tripped, write_tensors)

pytestmark = pytest.mark.usefixtures("one_thread")


def _quantized(name: str, array: np.ndarray) -> bool:
    return array.ndim >= 2 and array.shape[-1] % 32 == 0 and "gate.weight" not in name and "ffn_gate_inp" not in name


def write_ernie_gguf(path: Path, hf, tokenizer_json: Path, qtype: QT, fuse_gate_up: bool = False) -> Path:
    cfg = hf.config
    moe = cfg.model_type == "ernie4_5_moe"
    arch = gguf.MODEL_ARCH.ERNIE4_5_MOE if moe else gguf.MODEL_ARCH.ERNIE4_5
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny random ernie 4.5")
    add_decoder_keys(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if moe:
        w.add_expert_count(cfg.moe_num_experts)
        w.add_expert_used_count(cfg.moe_k)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.moe_num_shared_experts)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size)
    table = gguf.TensorNameMap(arch, cfg.num_hidden_layers)
    tensors = []
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if name.endswith(".mlp.gate.moe_statics.e_score_correction_bias"):
            tensors.append((f"blk.{name.split('.')[2]}.exp_probs_b.bias", array))
            continue
        experts = deepseek_expert_tensors(name, array)
        if experts is None:
            gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            experts = [(gguf_name, array)]
        tensors += [(n, np.ascontiguousarray(a)) for n, a in experts]
    if fuse_gate_up:
        tensors = fused_gate_up(tensors)
    write_tensors(w, ((n, a, qtype if _quantized(n, a) else QT.F32) for n, a in tensors))
    return path


@pytest.mark.parametrize("case, qtype, fuse", [("dense-bias", QT.F32, False), ("dense-bias", QT.Q8_0, False),
                                               ("moe", QT.F32, False), ("moe", QT.Q8_0, False), ("moe", QT.F32, True)])
def test_ernie_gguf_equals_transformers(case, qtype, fuse, tmp_path, tiny_tokenizer_dir):
    kind, overrides = CASES[case]
    hf = make_tiny_ernie(tmp_path / "hf", tiny_tokenizer_dir, kind, seed=9, **overrides)
    path = write_ernie_gguf(tmp_path / "ernie.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype, fuse)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == kind and config.use_bias == hf.config.use_bias
        if kind == "ernie4_5_moe":
            for key in ("moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index",
                        "moe_layer_interval", "moe_intermediate_size", "moe_num_shared_experts"):
                assert getattr(config, key) == getattr(hf.config, key), key
        check_greedy_alone_and_batched(llm, round_tripped(hf, qtype, _quantized), (5, 23))
