"""gpt-oss from llama.cpp's files (ggml-org's gpt-oss-20b / -120b GGUFs): arch "gpt-oss" as its
converter writes it from OpenAI's MXFP4 checkpoint: the experts' gate and up rows (interleaved
in the checkpoint) apart as ffn_gate_exps / ffn_up_exps, their biases likewise, each MXFP4
block repacked as llama.cpp holds it (scale byte, then 16 bytes of low / high nibble halves),
the attention sinks as attn_sinks.weight, YaRN by its keys. tessera keeps the MXFP4 stacks
packed (or dequantizes them where no builder runs them) and serves transformers' tokens and
logits; experts stored in F32 load too."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tessera.weights.safetensors import iter_hf_weights
from tests.models.parity import check_greedy_alone_and_batched, check_prefill_and_decode_logits
from tests.models.test_gpt_oss import NUM_KV_BLOCKS, make_mxfp4_checkpoint, make_tiny_gpt_oss
from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")
ARCH = "gpt-oss"


def llama_cpp_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's blocks [..., G, 16] (values in order, low nibble first) and scales [..., G]
    -> llama.cpp's rows [..., G * 17]: per block the scale, then value j | value j+16 << 4."""
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
    codes = values[..., :16] | (values[..., 16:] << 4)
    rows = torch.cat((scales.unsqueeze(-1), codes), dim=-1)
    return rows.flatten(-2).numpy()


def _metadata(w: gguf.GGUFWriter, cfg) -> None:
    add_decoder_keys(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _tensors(folder: Path, cfg) -> list[tuple[str, np.ndarray, QT]]:
    """The converter's tensors from a checkpoint folder (MXFP4 parts or dense stacks)."""
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    source = {name: t for name, t in iter_hf_weights(folder)}
    out = []
    for name, tensor in source.items():
        block = name.split(".")[2] if name.startswith("model.layers.") else None
        experts = f"blk.{block}.ffn_{{}}_exps"
        if name.endswith("experts.gate_up_proj_blocks") or name.endswith("experts.down_proj_blocks"):
            scales = source[name.replace("_blocks", "_scales")]
            if "gate_up" in name:  # rows interleave gate and up
                for half, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    out.append((experts.format(half) + ".weight", llama_cpp_mxfp4(tensor[:, rows], scales[:, rows]),
                                QT.MXFP4))
            else:
                out.append((experts.format("down") + ".weight", llama_cpp_mxfp4(tensor, scales), QT.MXFP4))
        elif name.endswith("_scales"):
            continue
        elif name.endswith("experts.gate_up_proj"):  # dense [E, H, 2I] (x @ W): rows of W.T
            weight = tensor.float().transpose(1, 2)
            out += [(experts.format("gate") + ".weight", weight[:, 0::2].numpy(), QT.F32),
                    (experts.format("up") + ".weight", weight[:, 1::2].numpy(), QT.F32)]
        elif name.endswith("experts.down_proj"):
            out.append((experts.format("down") + ".weight", tensor.float().transpose(1, 2).numpy(), QT.F32))
        elif name.endswith("experts.gate_up_proj_bias"):
            out += [(experts.format("gate") + ".bias", tensor[:, 0::2].float().numpy(), QT.F32),
                    (experts.format("up") + ".bias", tensor[:, 1::2].float().numpy(), QT.F32)]
        elif name.endswith("experts.down_proj_bias"):
            out.append((experts.format("down") + ".bias", tensor.float().numpy(), QT.F32))
        elif name.endswith("self_attn.sinks"):
            out.append((f"blk.{block}.attn_sinks.weight", tensor.float().numpy(), QT.F32))
        else:
            gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            out.append((gguf_name, tensor.float().numpy(), QT.F32))
    return out


def write_gpt_oss_gguf(path: Path, folder: Path, cfg, tokenizer_json: Path) -> Path:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny random gpt-oss")
    _metadata(w, cfg)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size)
    tensors = _tensors(folder, cfg)
    for name, array, stored in tensors:
        if stored == QT.MXFP4:  # already the stored rows
            w.add_tensor(name, array, raw_dtype=QT.MXFP4)
    write_tensors(w, ((name, array, stored) for name, array, stored in tensors if stored != QT.MXFP4))
    return path


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dequantized"])
def test_mxfp4_gguf_equals_transformers(packed, tmp_path, tiny_tokenizer_dir, monkeypatch):
    from tessera.models.gpt_oss import modeling
    from tessera.ops.moe_mxfp4 import Mxfp4Experts

    hf = make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir)
    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", tmp_path / "mxfp4", hf.config,
                              Path(tiny_tokenizer_dir) / "tokenizer.json")
    if not packed:
        monkeypatch.setattr(modeling, "mxfp4_experts_available", lambda target: False)
    with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.config
        assert config.model_type == "gpt_oss" and config.layer_types == hf.config.layer_types
        assert config.rope_parameters["truncate"] is False and config.sliding_window == hf.config.sliding_window
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        assert isinstance(experts, Mxfp4Experts) == packed
        check_prefill_and_decode_logits(llm, hf, "gpt_oss-gguf", monkeypatch)
        check_greedy_alone_and_batched(llm, hf, (5, 23))


def test_dense_experts_gguf_equals_transformers(tmp_path, tiny_tokenizer_dir):
    hf = make_tiny_gpt_oss(tmp_path / "dense", tiny_tokenizer_dir, seed=5, intermediate_size=64)
    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", tmp_path / "dense", hf.config,
                              Path(tiny_tokenizer_dir) / "tokenizer.json")
    with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        assert getattr(llm.engine.router.config, "quantization_config", None) is None
        check_greedy_alone_and_batched(llm, hf, (5, 23))


def test_two_ranks_take_their_halves_of_the_packed_stacks(tmp_path, tiny_tokenizer_dir):
    hf = make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir)
    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", tmp_path / "mxfp4", hf.config,
                              Path(tiny_tokenizer_dir) / "tokenizer.json")
    with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False, cache_dir=tmp_path / "cache",
             tensor_parallel_size=2) as llm:
        check_greedy_alone_and_batched(llm, hf, (5, 23))


def test_mixed_expert_types_load_dequantized_and_fused_stacks_are_refused(tmp_path, tiny_tokenizer_dir):
    """An expert stack stored in another type than MXFP4 (llama.cpp's --tensor-type) makes the
    whole model's experts load dequantized; gate and up fused (--fuse-gate-up-exps) are refused
    by name rather than de-interleaved wrongly."""
    from tessera.ops.moe_mxfp4 import Mxfp4Experts

    hf = make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir)
    tensors = _tensors(tmp_path / "mxfp4", hf.config)
    down = next(i for i, (name, _, _) in enumerate(tensors) if name == "blk.0.ffn_down_exps.weight")
    experts = hf.model.layers[0].mlp.experts.down_proj.detach()  # [E, I, H] (x @ W): the file's rows are W.T
    tensors[down] = ("blk.0.ffn_down_exps.weight", experts.transpose(1, 2).float().numpy().copy(), QT.F32)
    for name, mutate in (("mixed", lambda t: t), ("fused", _fuse_first_block)):
        path = tmp_path / f"{name}.gguf"
        w = gguf.GGUFWriter(str(path), ARCH)
        _metadata(w, hf.config)
        add_tokenizer(w, Path(tiny_tokenizer_dir) / "tokenizer.json", hf.config.vocab_size)
        stored = mutate(list(tensors))
        for tensor_name, array, kind in stored:
            if kind == QT.MXFP4:
                w.add_tensor(tensor_name, array, raw_dtype=QT.MXFP4)
        write_tensors(w, ((n, a, k) for n, a, k in stored if k != QT.MXFP4))
        if name == "fused":
            with pytest.raises(ValueError, match="fuse-gate-up-exps"):
                LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
                    cache_dir=tmp_path / "cache")
            continue
        with LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
                 cache_dir=tmp_path / "cache") as llm:
            assert not isinstance(llm.engine.runner.model.model.layers[0].mlp.experts, Mxfp4Experts)
            check_greedy_alone_and_batched(llm, hf, (5, 23))


def _fuse_first_block(tensors: list) -> list:
    """Layer 0's gate and up stacks as one ffn_gate_up_exps (their bytes side by side)."""
    by_name = {name: (array, kind) for name, array, kind in tensors}
    gate, kind = by_name["blk.0.ffn_gate_exps.weight"]
    up, _ = by_name["blk.0.ffn_up_exps.weight"]
    kept = [t for t in tensors if t[0] not in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight")]
    return kept + [("blk.0.ffn_gate_up_exps.weight", np.concatenate((gate, up), axis=1), kind)]
