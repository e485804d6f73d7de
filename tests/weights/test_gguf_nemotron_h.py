"""Nemotron-H and Nemotron 3 from llama.cpp's files: archs "nemotron_h" and "nemotron_h_moe" as
its converter writes them (per-layer KV head counts and feed-forward widths, 0 where a block
has none: Mamba-2 where both are; every block's norm as attn_norm; the Mamba-2 tensors as
Granite 4.0-H's files keep them; Q / K permuted as Llama's; stacked gateless experts, the
router's choice bias as exp_probs_b, the shared expert, the latent projections), read by
tessera: the same logits and greedy tokens as transformers, F32 and Q8_0."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.test_nemotron_h import make_tiny_nemotron_h
from tests.weights.gguf_hybrids import (add_ssm_keys, assert_mamba2_vectors_back, check_equals_reference,
                                       llama_cpp_hybrid_tensor, loaded_hybrid)
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")


def _arch(cfg) -> str:
    return "nemotron_h_moe" if "moe" in cfg.layers_block_type else "nemotron_h"


def _metadata(w: gguf.GGUFWriter, cfg) -> None:
    blocks = list(cfg.layers_block_type)
    moe = "moe" in blocks
    width = cfg.moe_intermediate_size if moe else cfg.intermediate_size
    add_decoder_keys(w, cfg, feed_forward=[width if b in ("mlp", "moe") else 0 for b in blocks],
                     head_count_kv=[cfg.num_key_value_heads if b == "full_attention" else 0 for b in blocks])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)
    add_ssm_keys(w, conv_kernel=cfg.conv_kernel, state=cfg.ssm_state_size, groups=cfg.n_groups,
                 inner=cfg.mamba_num_heads * cfg.mamba_head_dim, heads=cfg.mamba_num_heads)
    if moe:
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
        if cfg.n_group > 1:  # (llama.cpp reads it where there are groups)
            w.add_expert_group_used_count(cfg.topk_group)
        if cfg.moe_latent_size is not None:
            w.add_moe_latent_size(cfg.moe_latent_size)


def _tensors(hf) -> list[tuple[str, np.ndarray]]:
    cfg = hf.config
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.NEMOTRON_H_MOE if _arch(cfg).endswith("moe")
                               else gguf.MODEL_ARCH.NEMOTRON_H, cfg.num_hidden_layers)
    out = []
    for name, tensor in hf.state_dict().items():
        t = tensor.detach().float()
        block = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):  # stacked [E, out, in]
            proj = name.rsplit(".", 1)[1].split("_")[0]
            out.append((f"blk.{block}.ffn_{proj}_exps.weight", t.numpy()))
            continue
        t = llama_cpp_hybrid_tensor(name, t, cfg, cfg.n_groups)
        # the converter reads the original checkpoint's names (backbone.*)
        lookup = (name.replace("model.", "backbone.", 1).replace("mixer.dt_bias", "mixer.dt.bias")
                  .replace("gate.e_score_correction_bias", "gate.e_score_correction.bias"))
        gguf_name = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out.append((gguf_name, np.ascontiguousarray(t.numpy())))
    return out


def _quantized(name: str, array: np.ndarray) -> bool:
    """What llama.cpp quantizes (by its name or the checkpoint's): 2-D and stacked weights
    whose rows fill Q8_0 blocks, not the conv, norms or router."""
    return (array.ndim >= 2 and array.shape[-1] % 32 == 0 and "conv1d" not in name and "norm" not in name
            and "ffn_gate_inp" not in name and "mixer.gate." not in name)


def write_nemotron_h_gguf(path: Path, hf, tokenizer_json: Path, qtype: QT) -> Path:
    w = gguf.GGUFWriter(str(path), _arch(hf.config))
    w.add_name("tiny random nemotron-h")
    _metadata(w, hf.config)
    add_tokenizer(w, tokenizer_json, hf.config.vocab_size)
    write_tensors(w, ((n, a, qtype if _quantized(n, a) else QT.F32) for n, a in _tensors(hf)))
    return path


@pytest.mark.parametrize("case, qtype", [("nemotron-h-two-groups", QT.F32), ("nemotron-h-one-group", QT.Q8_0),
                                         ("nemotron-3-moe-latent", QT.F32), ("nemotron-3-moe", QT.Q8_0)])
def test_nemotron_h_gguf_equals_transformers(case, qtype, tmp_path, tiny_tokenizer_dir, monkeypatch):
    hf = make_tiny_nemotron_h(case, tmp_path / "hf", tiny_tokenizer_dir, seed=3)
    path = write_nemotron_h_gguf(tmp_path / "nemotron.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    with loaded_hybrid(path, tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == "nemotron_h"
        assert list(config.layers_block_type) == list(hf.config.layers_block_type)
        if "moe" in case:
            for field in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
                          "moe_shared_expert_intermediate_size", "norm_topk_prob", "moe_latent_size"):
                assert getattr(config, field) == getattr(hf.config, field), field
            assert config.routed_scaling_factor == pytest.approx(hf.config.routed_scaling_factor)
        assert_mamba2_vectors_back(llm.engine.runner.model.model.layers[0].mixer, hf.model.layers[0].mixer)
        check_equals_reference(llm, hf, qtype, _quantized, f"nemotron-h-gguf-{case}", monkeypatch)


def test_expert_groups_without_their_used_count_are_refused(tmp_path, tiny_tokenizer_dir):
    """Groups of experts with no `expert_group_used_count`: how many a token may use is not
    guessed."""
    hf = make_tiny_nemotron_h("nemotron-3-moe", tmp_path / "hf", tiny_tokenizer_dir, seed=3)
    path = tmp_path / "groups.gguf"
    w = gguf.GGUFWriter(str(path), "nemotron_h_moe")
    _metadata(w, hf.config)
    add_tokenizer(w, Path(tiny_tokenizer_dir) / "tokenizer.json", hf.config.vocab_size)
    tensors = _tensors(hf)
    # (the used count dropped from what _metadata wrote)
    w.kv_data[0].pop("nemotron_h_moe.expert_group_used_count")
    write_tensors(w, ((n, a, QT.F32) for n, a in tensors))
    with pytest.raises(ValueError, match="expert_group_used_count"):
        LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache")
