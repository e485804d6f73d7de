"""LFM2 from llama.cpp's files (LiquidAI's LFM2 GGUFs): arch "lfm2" as its converter writes it:
the per-layer KV head counts (0 for the convolution layers), the convolution's width, the
feed-forward width after block_auto_adjust_ff_dim, the conv kernels squeezed to [C, K], the
final norm as token_embd_norm. Read by tessera (transformers' conversion takes the per-layer
head counts as one number); the same greedy tokens as transformers, F32 and Q8_0, tied and
untied."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tessera.models.lfm2.modeling import feed_forward_size
from tests.models.parity import check_greedy_alone_and_batched
from tests.models.test_lfm2 import make_tiny_lfm2
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, round_tripped, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")
ARCH = "lfm2"


def _quantized(name: str, array: np.ndarray) -> bool:
    """What the file stores in the quantized type (the conv kernels, norms and router stay F32)."""
    return array.ndim >= 2 and array.shape[-1] % 32 == 0 and "conv.conv" not in name and "feed_forward.gate" not in name


def write_lfm2_gguf(path: Path, hf, tokenizer_json: Path, qtype: QT) -> Path:
    cfg = hf.config
    moe = cfg.model_type == "lfm2_moe"
    w = gguf.GGUFWriter(str(path), "lfm2moe" if moe else ARCH)
    w.add_name("tiny random lfm2")
    add_decoder_keys(w, cfg, feed_forward=feed_forward_size(cfg),
                     head_count_kv=[cfg.num_key_value_heads if kind != "conv" else 0 for kind in cfg.layer_types])
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size)
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.LFM2MOE if moe else gguf.MODEL_ARCH.LFM2, cfg.num_hidden_layers)
    tensors = []
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        block = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("feed_forward.experts.gate_up_proj"):  # [E, 2I, H]: gate (w1) rows, then up (w3)
            half = array.shape[1] // 2
            for part, rows in (("gate", array[:, :half]), ("up", array[:, half:])):
                tensors.append((f"blk.{block}.ffn_{part}_exps.weight", np.ascontiguousarray(rows),
                                qtype if _quantized(name, rows) else QT.F32))
            continue
        if name.endswith("feed_forward.experts.down_proj"):
            tensors.append((f"blk.{block}.ffn_down_exps.weight", array, qtype if _quantized(name, array) else QT.F32))
            continue
        if name.endswith("feed_forward.expert_bias"):
            tensors.append((f"blk.{block}.exp_probs_b.bias", array, QT.F32))
            continue
        if name.endswith("conv.conv.weight"):
            array = array.squeeze(1)
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        stored = qtype if _quantized(name, array) else QT.F32
        tensors.append((gguf_name, np.ascontiguousarray(array), stored))
    write_tensors(w, tensors)
    return path


@pytest.mark.parametrize("case, qtype", [("lfm2-biased-conv", QT.F32), ("lfm2-tied", QT.Q8_0), ("lfm2-moe", QT.F32),
                                         ("lfm2-moe", QT.Q8_0)])
def test_lfm2_gguf_equals_transformers(case, qtype, tmp_path, tiny_tokenizer_dir):
    # (llama.cpp's LFM2-MoE has no output tensor: its embedding is tied, as in the release)
    hf = make_tiny_lfm2(case, tmp_path / "hf", tiny_tokenizer_dir, seed=7,
                        **({"tie_word_embeddings": True} if case == "lfm2-moe" else {}))
    path = write_lfm2_gguf(tmp_path / "lfm2.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == hf.config.model_type and config.layer_types == hf.config.layer_types
        assert feed_forward_size(config) == feed_forward_size(hf.config) and config.conv_bias == hf.config.conv_bias
        check_greedy_alone_and_batched(llm, round_tripped(hf, qtype, _quantized), (5, 23))
