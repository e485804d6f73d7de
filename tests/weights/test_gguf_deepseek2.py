"""DeepSeek-V2 / V3 and GLM-4.7-Flash from llama.cpp's files: a GGUF of arch "deepseek2" as its
converter writes one, read without transformers' GGUF conversion (which does not know the
arch): the same greedy tokens and logprobs as the transformers model the file was written
from. Both layouts of the latent attention's up-projection: the current one (the file's
attention as MQA over the latent, kv_b_proj split into attn_k_b, its key half transposed,
and attn_v_b; the per-head sizes in key_length_mla / value_length_mla) and the one before it
(attn_kv_b whole, the per-head sizes in key_length / value_length). V3's sigmoid routing
with groups and YaRN (mscale_all_dim as yarn_log_multiplier), V2's softmax routing, F32 and
Q8_0."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_alone_and_batched
from tests.models.test_deepseek import CASES, make_tiny_deepseek
from tests.weights.gguf_writer import (add_decoder_keys, add_tokenizer, deepseek_expert_tensors, fused_gate_up,
                                       write_tensors)
from tests.weights.test_gguf_models import dequantized

pytestmark = pytest.mark.usefixtures("one_thread")
ARCH = "deepseek2"


def _metadata(w: gguf.GGUFWriter, cfg, split_kv_b: bool, gating: int | None = None) -> None:
    heads, rope = cfg.num_attention_heads, cfg.qk_rope_head_dim
    add_decoder_keys(w, cfg, head_count_kv=1 if split_kv_b else heads)  # split: MQA over the latent
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    dense = getattr(cfg, "first_k_dense_replace", None)
    if dense is None:  # GLM-4.7-Flash: its dense layers lead
        dense = next(i for i, kind in enumerate(cfg.mlp_layer_types) if kind != "dense")
    w.add_leading_dense_block_count(dense)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if split_kv_b:  # the per-head sizes in the _mla keys
        w.add_key_length(cfg.kv_lora_rank + rope)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_key_length(cfg.qk_nope_head_dim + rope)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    if gating is None:
        v2 = cfg.model_type == "deepseek_v2"
        gating = gguf.ExpertGatingFuncType.SOFTMAX if v2 else gguf.ExpertGatingFuncType.SIGMOID
    w.add_uint32(f"{ARCH}.expert_gating_func", int(gating))
    w.add_rope_dimension_count(rope)
    params = cfg.rope_parameters
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _tensors(hf, split_kv_b: bool) -> list[tuple[str, np.ndarray]]:
    cfg = hf.config
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    out = []
    for name, tensor in hf.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        experts = deepseek_expert_tensors(name, array)
        if experts is not None:
            out += experts
            continue
        block = name.split(".")[2] if name.startswith("model.layers.") else None
        if split_kv_b and name.endswith(".self_attn.kv_b_proj.weight"):
            per_head = array.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            out += [(f"blk.{block}.attn_k_b.weight", per_head[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1).copy()),
                    (f"blk.{block}.attn_v_b.weight", per_head[:, cfg.qk_nope_head_dim:].copy())]
            continue
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out.append((gguf_name, array))
    return out


def write_deepseek2_gguf(path: Path, hf, tokenizer_json: Path, split_kv_b: bool, qtype: QT = QT.F32,
                         fuse_gate_up: bool = False) -> Path:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny random deepseek")
    _metadata(w, hf.config, split_kv_b)
    add_tokenizer(w, tokenizer_json, hf.config.vocab_size)
    tensors = _tensors(hf, split_kv_b)
    write_tensors(w, ((name, array, qtype if array.ndim >= 2 and "ffn_gate_inp" not in name else QT.F32)
                      for name, array in (fused_gate_up(tensors) if fuse_gate_up else tensors)))
    return path


@pytest.mark.parametrize("case, split_kv_b, qtype, fuse_gate_up", [
    ("v3-yarn-qlora", True, QT.F32, False), ("glm4-moe-lite", True, QT.F32, False),
    ("v2-group-limited", False, QT.F32, False), ("v2-lite-greedy", False, QT.Q8_0, False),
    ("v2-lite-greedy", True, QT.F32, False), ("v3-yarn-qlora", True, QT.F32, True)])
def test_deepseek2_gguf_equals_transformers(tmp_path, tiny_tokenizer_dir, case, split_kv_b, qtype, fuse_gate_up):
    kind, overrides = CASES[case]
    hf = make_tiny_deepseek(tmp_path / "hf", tiny_tokenizer_dir, kind, seed=6, **overrides)
    path = write_deepseek2_gguf(tmp_path / "ds.gguf", hf, tmp_path / "hf" / "tokenizer.json", split_kv_b, qtype,
                                fuse_gate_up)
    reference = dequantized(hf, qtype)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == ("deepseek_v2" if kind == "deepseek_v2" else "deepseek_v3")
        for key in ("num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                    "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                    "moe_intermediate_size", "intermediate_size", "routed_scaling_factor", "n_group", "topk_group"):
            want = getattr(hf.config, key)  # (the file's floats are float32)
            assert getattr(config, key) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
        if kind == "deepseek_v2":
            assert config.topk_method == hf.config.topk_method
        else:
            assert config.norm_topk_prob == hf.config.norm_topk_prob
        if hf.config.rope_parameters.get("rope_type") == "yarn":
            for key in ("factor", "original_max_position_embeddings", "mscale_all_dim"):
                assert config.rope_parameters[key] == hf.config.rope_parameters[key], key
        check_greedy_alone_and_batched(llm, reference, (5, 23))


def test_deepseek2_gguf_refuses_unknown_gating(tmp_path, tiny_tokenizer_dir):
    kind, overrides = CASES["v2-lite-greedy"]
    hf = make_tiny_deepseek(tmp_path / "hf", tiny_tokenizer_dir, kind, seed=6, **overrides)
    path = tmp_path / "ds.gguf"
    w = gguf.GGUFWriter(str(path), ARCH)
    _metadata(w, hf.config, True, gating=3)  # sqrt-softplus (DeepSeek V4's)
    add_tokenizer(w, tmp_path / "hf" / "tokenizer.json", hf.config.vocab_size)
    write_tensors(w, ((name, array, QT.F32) for name, array in _tensors(hf, True)))
    with pytest.raises(ValueError, match="gating function 3"):
        LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache")


def test_two_ranks_split_the_latent_halves_by_heads(tmp_path, tiny_tokenizer_dir):
    """Tensor parallelism over the split layout: each rank takes its heads' rows of attn_k_b and
    attn_v_b (and its experts); the greedy tokens stay transformers'."""
    kind, overrides = CASES["v3-yarn-qlora"]
    hf = make_tiny_deepseek(tmp_path / "hf", tiny_tokenizer_dir, kind, seed=6, **overrides)
    path = write_deepseek2_gguf(tmp_path / "ds.gguf", hf, tmp_path / "hf" / "tokenizer.json", True)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache",
             tensor_parallel_size=2) as llm:
        check_greedy_alone_and_batched(llm, hf, (5, 23))
