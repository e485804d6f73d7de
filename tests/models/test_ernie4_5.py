"""Tessera's ERNIE 4.5 against transformers' on tiny random checkpoints: the dense model
(interleaved rotary over the whole head, biases everywhere when use_bias) and the MoE one
(dense first layer, softmax routing chosen with the correction bias, renormalised weights,
shared experts), the latter also in Baidu's own layout (one tensor per expert, the bias under
mlp.moe_statics). Router weights and biases are drawn large enough that tokens spread over
experts; norms are randomised."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera import LLM
from tessera.models.ernie4_5.modeling import Ernie45MoE
from tests.models.parity import VOCAB, Case, LogitParity, make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MOE = dict(moe_intermediate_size=32, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
           moe_layer_end_index=2, moe_layer_interval=1)
CASES = {"dense-bias": ("ernie4_5", dict(use_bias=True, tie_word_embeddings=True)),
         "moe": ("ernie4_5_moe", MOE), "moe-baidu-layout": ("ernie4_5_moe", MOE)}


def _tweak(model: torch.nn.Module, g: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):  # decisive, varied choices
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        elif name.endswith("proj.bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def make_tiny_ernie(folder: Path, tokenizer_dir: Path, kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    config_cls, model_cls = {"ernie4_5": (Ernie4_5Config, Ernie4_5ForCausalLM),
                             "ernie4_5_moe": (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM)}[kind]
    return make_tiny(folder, tokenizer_dir, config_cls, model_cls, seed=seed, base=BASE, tweak=_tweak, **overrides)


def as_baidu_layout(folder: Path) -> None:
    """One tensor per expert (gate / up / down_proj), the bias under mlp.moe_statics, and a
    multi-token-prediction head beside the model (not served)."""
    out = {"model.mtp_emb_norm.0.weight": torch.ones(64), "model.mtp_hidden_norm.0.weight": torch.ones(64),
           "model.mtp_linear_proj.0.weight": torch.zeros(64, 128),
           "model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(64, 64)}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            prefix, half = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{name.removesuffix('.down_proj')}.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name.replace(".mlp.gate.moe_statics.", ".mlp.moe_statics.")] = tensor
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    kind, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_ernie(folder, tiny_tokenizer_dir, kind, seed=len(request.param), **overrides)
    if request.param == "moe-baidu-layout":
        as_baidu_layout(folder)
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def test_layers_are_what_the_config_says(case: Case):
    model = case.llm.engine.runner.model
    moe = case.hf.config.model_type == "ernie4_5_moe"
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.mlp, Ernie45MoE) == (moe and i >= 1)
        assert layer.self_attn.rotary.interleaved  # (neighbouring pairs)
    if moe:
        gate = model.model.layers[-1].mlp.gate
        assert gate.e_score_correction_bias.abs().sum() > 0
        _, ids = gate(torch.randn(64, 64))
        assert len(ids.unique()) >= 4


class TestParity(LogitParity):
    num_kv_blocks, prompt_lengths = NUM_KV_BLOCKS, PROMPT_LENGTHS
