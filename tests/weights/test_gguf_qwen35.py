"""Qwen3.5 (dense) from llama.cpp's files: arch "qwen35" as its converter writes it (Gated
DeltaNet value heads tiled rather than grouped by key head wherever they appear, A_log as
-exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed, every (1 + w) norm with the 1 added but
the gated one, layers by full_attention_interval), read back by tessera
(weights/gguf_qwen35.py): the same greedy tokens as transformers' model, F32 and Q8_0, with
more value heads than key heads (where the reordering matters) and with as many."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_alone_and_batched
from tests.models.test_qwen3_next import make_tiny_qwen3_next
from tests.weights.gguf_hybrids import add_ssm_keys
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, round_tripped, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")
ARCH = "qwen35"


def _tiled(tensor: torch.Tensor, dim: int, num_k: int, per_k: int, head: int) -> torch.Tensor:
    """The converter's reordering: value heads grouped by key head -> tiled."""
    shape = list(tensor.shape)
    return tensor.reshape(shape[:dim] + [num_k, per_k, head] + shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def split_qkvz(cfg, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz (per key head: q, k, v, z) as the converter stores it: all
    queries, keys, values (attn_qkv), then all z (attn_gate)."""
    num_k, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vz = cfg.linear_num_value_heads // num_k * cfg.linear_value_head_dim
    per_head = tensor.detach().float().reshape(num_k, 2 * dk + 2 * vz, -1)
    q, k, v, z = per_head.split((dk, dk, vz, vz), dim=1)
    return torch.cat([part.reshape(-1, per_head.shape[-1]) for part in (q, k, v)]), z.reshape(-1, per_head.shape[-1])


def converted(cfg, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(Hugging Face name for the converter's name table, tensor) as llama.cpp stores it."""
    t = tensor.detach().float()
    num_k, num_v, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim)
    per_k, qk = num_v // num_k, 2 * num_k * dk
    if name.endswith("conv1d.weight"):
        t = t.squeeze(1)
    if cfg.model_type == "qwen3_next":  # its value heads keep their grouping: no reordering
        num_k, per_k = num_v, 1
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        t = torch.cat((t[:qk], _tiled(t[qk:], 0, num_k, per_k, dv)))
    elif name.endswith("in_proj_z.weight"):
        t = _tiled(t, 0, num_k, per_k, dv)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        t = _tiled(t, 0, num_k, per_k, 1)
    elif name.endswith("out_proj.weight") and ".linear_attn." in name:
        t = _tiled(t, 1, num_k, per_k, dv)
    if name.endswith("A_log"):
        t = -torch.exp(t)
    if name.endswith("dt_bias"):
        name = name.replace("dt_bias", "dt_proj.bias")
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def _quantized(array: np.ndarray) -> bool:
    return array.ndim >= 2 and array.shape[-1] % 32 == 0


def write_qwen35_gguf(path: Path, hf, tokenizer_json: Path, qtype: QT, chat_template: str | None = None) -> Path:
    """`hf` (a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next causal LM) as the converter writes it; the
    M-RoPE sections are its config's, else the tiny checkpoints' (2, 1, 1)."""
    cfg = hf.config
    moe = cfg.model_type != "qwen3_5_text"
    arch = {"qwen3_5_text": ARCH, "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny random qwen3.5")
    add_decoder_keys(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections((list(cfg.rope_parameters.get("mrope_section") or [2, 1, 1]) + [0] * 4)[:4])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    add_ssm_keys(w, conv_kernel=cfg.linear_conv_kernel_dim, state=cfg.linear_key_head_dim,
                 groups=cfg.linear_num_key_heads, inner=cfg.linear_value_head_dim * cfg.linear_num_value_heads,
                 heads=cfg.linear_num_value_heads)
    w.add_full_attention_interval(cfg.layer_types.index("full_attention") + 1)
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size, **({"chat_template": chat_template} if chat_template else {}))
    table = gguf.TensorNameMap({"qwen35": gguf.MODEL_ARCH.QWEN35, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
                                "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}[arch], cfg.num_hidden_layers)
    tensors = []
    for name, tensor in hf.state_dict().items():
        if name.endswith("in_proj_qkvz.weight"):
            block = name.split(".")[2]
            qkv, z = split_qkvz(cfg, tensor)
            tensors += [(f"blk.{block}.attn_qkv.weight", qkv.numpy(), qtype if _quantized(qkv.numpy()) else QT.F32),
                        (f"blk.{block}.attn_gate.weight", z.numpy(), qtype if _quantized(z.numpy()) else QT.F32)]
            continue
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # stacked: [E, 2I, H], [E, H, I]
            block, array = name.split(".")[2], tensor.detach().float().numpy()
            parts = ({"gate": array[:, :cfg.moe_intermediate_size], "up": array[:, cfg.moe_intermediate_size:]}
                     if name.endswith("gate_up_proj") else {"down": array})
            tensors += [(f"blk.{block}.ffn_{proj}_exps.weight", np.ascontiguousarray(part),
                         qtype if _quantized(part) else QT.F32) for proj, part in parts.items()]
            continue
        name, t = converted(cfg, name, tensor)
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = np.ascontiguousarray(t.numpy())
        tensors.append((gguf_name, array, qtype if _quantized(array) else QT.F32))
    write_tensors(w, tensors)
    return path


@pytest.mark.parametrize("kind, heads, qtype", [
    ("qwen3_5_text", (2, 4), QT.F32), ("qwen3_5_text", (2, 4), QT.Q8_0), ("qwen3_5_text", (2, 2), QT.F32),
    ("qwen3_5_moe_text", (2, 4), QT.F32), ("qwen3_5_moe_text", (2, 4), QT.Q8_0), ("qwen3_next", (2, 4), QT.F32),
    ("qwen3_next", (2, 4), QT.Q8_0)],
    ids=["grouped-f32", "grouped-q8_0", "equal-f32", "moe-f32", "moe-q8_0", "next-f32", "next-q8_0"])
def test_qwen35_gguf_equals_transformers(kind, heads, qtype, tmp_path, tiny_tokenizer_dir):
    num_k, num_v = heads
    # (llama.cpp's qwen3next has experts in every layer, as the released model)
    extra = {"mlp_only_layers": []} if kind == "qwen3_next" else {}
    hf = make_tiny_qwen3_next(kind, tmp_path / "hf", tiny_tokenizer_dir, seed=8,
                              linear_num_key_heads=num_k, linear_num_value_heads=num_v, **extra)
    path = write_qwen35_gguf(tmp_path / "qwen35.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == kind and config.layer_types == hf.config.layer_types
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel_dim", "head_dim"):
            assert getattr(config, key) == getattr(hf.config, key), key
        check_greedy_alone_and_batched(llm, round_tripped(hf, qtype, lambda _, a: _quantized(a)), (5, 23))


def test_two_ranks(tmp_path, tiny_tokenizer_dir):
    hf = make_tiny_qwen3_next("qwen3_5_text", tmp_path / "hf", tiny_tokenizer_dir, seed=8)
    path = write_qwen35_gguf(tmp_path / "qwen35.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", QT.F32)
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=tmp_path / "cache",
             tensor_parallel_size=2) as llm:
        check_greedy_alone_and_batched(llm, hf, (5, 23))
