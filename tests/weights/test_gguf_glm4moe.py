"""GLM-4.5 from llama.cpp's files: a GGUF of arch "glm4moe" as its converter writes one (the
experts' keys, rotary over rope.dimension_count of each head, the MTP layer as an extra
block counted into block_count with its nextn.* tensors, the experts stacked as
ffn_*_exps, the shared ones as ffn_*_shexp, the correction bias as exp_probs_b.bias), read
without transformers' GGUF conversion (which does not know the arch): the same logits and
greedy tokens as transformers' model the file was written from, F32 and Q8_0."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_alone_and_batched
from tests.models.test_glm4_moe import CASES, make_tiny_glm4_moe
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, deepseek_expert_tensors, write_tensors
from tests.weights.test_gguf_models import dequantized

pytestmark = pytest.mark.usefixtures("one_thread")
ARCH = "glm4moe"


def _metadata(w: gguf.GGUFWriter, cfg) -> None:
    head_dim = cfg.head_dim
    add_decoder_keys(w, cfg, blocks=cfg.num_hidden_layers + 1)  # the MTP layer counted in
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.n_group > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_nextn_predict_layers(1)


def _tensors(hf) -> list[tuple[str, np.ndarray]]:
    cfg = hf.config
    last = cfg.num_hidden_layers - 1
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.GLM4_MOE, cfg.num_hidden_layers + 1)
    out = []
    for name, tensor in hf.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        experts = deepseek_expert_tensors(name, array)
        if experts is not None:
            out += experts
            continue
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out.append((gguf_name, array))
    # the MTP block after the model's: a copy of the last layer's tensors and its own nextn.*
    mtp = [(n.replace(f"blk.{last}.", f"blk.{last + 1}."), a) for n, a in out if n.startswith(f"blk.{last}.")]
    hidden = cfg.hidden_size
    mtp += [(f"blk.{last + 1}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), np.float32)),
            (f"blk.{last + 1}.nextn.enorm.weight", np.ones(hidden, np.float32)),
            (f"blk.{last + 1}.nextn.hnorm.weight", np.ones(hidden, np.float32))]
    return out + mtp


def write_glm4moe_gguf(path: Path, hf, tokenizer_json: Path, qtype: QT = QT.F32) -> Path:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny random glm4_moe")
    _metadata(w, hf.config)
    add_tokenizer(w, tokenizer_json, hf.config.vocab_size)
    write_tensors(w, ((name, array, qtype if array.ndim >= 2 and "ffn_gate_inp" not in name else QT.F32)
                      for name, array in _tensors(hf)))
    return path


@pytest.mark.parametrize("case, qtype", [("glm45", QT.F32), ("qk-norm-groups", QT.F32), ("glm45", QT.Q8_0)])
def test_glm4moe_gguf_equals_transformers(tmp_path, tiny_tokenizer_dir, case, qtype):
    hf = make_tiny_glm4_moe(tmp_path / "hf", tiny_tokenizer_dir, seed=4, **CASES[case])
    path = write_glm4moe_gguf(tmp_path / "glm.gguf", hf, tmp_path / "hf" / "tokenizer.json", qtype)
    reference = dequantized(hf, qtype)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == "glm4_moe" and config.num_hidden_layers == hf.config.num_hidden_layers
        for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                    "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
                    "use_qk_norm", "attention_bias", "head_dim"):
            assert getattr(config, key) == getattr(hf.config, key), key
        assert config.rope_parameters["partial_rotary_factor"] == 0.5
        check_greedy_alone_and_batched(llm, reference, (5, 23))
