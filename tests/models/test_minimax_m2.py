"""Tessera's MiniMax-M2 against transformers' on tiny random checkpoints: RMSNorms over the
whole query and key projections, rotary over half of each head (the released configs'
rotary_dim), sigmoid-routed experts with the correction bias in every layer; saved as
transformers writes it and as MiniMax publishes it (Mixtral's expert names, the bias under
block_sparse_moe). Router weights and biases are drawn large enough that tokens spread over
experts; norms are randomised."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera import LLM
from tessera.models.minimax_m2.modeling import MiniMaxM2MoE
from tests.models.parity import VOCAB, Case, LogitParity, make_tiny
from tests.models.test_deepseek import _decisive_routers

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
            tie_word_embeddings=False, rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_tiny_minimax_m2(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    return make_tiny(folder, tokenizer_dir, MiniMaxM2Config, MiniMaxM2ForCausalLM, seed=seed, base=BASE,
                     tweak=_decisive_routers, **overrides)


def as_published(folder: Path) -> None:
    """Rewrite the checkpoint in MiniMax's own names: Mixtral's per-expert w1 / w3 / w2 under
    block_sparse_moe, its gate and the correction bias beside it."""
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if ".mlp.experts.gate_up_proj" in name:  # [E, 2I, H]: gate rows, then up rows
            prefix = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = tensor[e, :half].clone()
                out[f"{prefix}.{e}.w3.weight"] = tensor[e, half:].clone()
        elif ".mlp.experts.down_proj" in name:  # [E, H, I]
            prefix = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = tensor[e].clone()
        else:
            out[name.replace(".mlp.", ".block_sparse_moe.")] = tensor
    assert any(".block_sparse_moe.e_score_correction_bias" in n for n in out)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["transformers-layout", "published-layout"])
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_minimax_m2(folder, tiny_tokenizer_dir, seed=len(request.param))
    if request.param == "published-layout":
        as_published(folder)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_layers_are_what_the_config_says(case: Case):
    model = case.llm.engine.runner.model
    for layer in model.model.layers:
        assert isinstance(layer.mlp, MiniMaxM2MoE) and layer.mlp.shared_experts is None
        assert layer.self_attn.rotary.rotary_dim == 8 and layer.self_attn.q_norm.weight.numel() == 64
    gate = model.model.layers[-1].mlp.gate
    assert gate.e_score_correction_bias.abs().sum() > 0  # (drawn: loaded from either layout)
    _, ids = gate(torch.randn(64, 64))
    assert len(ids.unique()) >= 4


class TestParity(LogitParity):
    num_kv_blocks, prompt_lengths = NUM_KV_BLOCKS, PROMPT_LENGTHS


def test_multi_token_prediction_modules_are_skipped(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """The released configs count num_mtp_modules; their layers after the model's are not loaded."""
    import json

    from tests.models.parity import check_prefill_and_decode_logits

    hf = make_tiny_minimax_m2(tmp_path, tiny_tokenizer_dir, seed=6)
    tensors = load_file(tmp_path / "model.safetensors")
    mtp = {name.replace("model.layers.1.", "model.layers.2."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.1.")}
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_mtp_modules"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(tmp_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    check_prefill_and_decode_logits(llm, hf, "minimax_m2-mtp", monkeypatch)
