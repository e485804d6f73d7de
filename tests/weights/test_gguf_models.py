"""GGUF files of Gemma 2, Phi-3 (4k and longrope), Mixtral, Qwen3-MoE and SmolLM3 (arch smollm3:
Llama's tensors, Q / K permuted, NoPE layers the file does not name), written the way
llama.cpp's convert_hf_to_gguf.py writes them (tests/weights/gguf_writer.py: Gemma's norms
stored as 1 + w under its own four names, Phi-3's fused projections kept whole with gate_up
as ffn_up and its longrope factors as tensors, Mixtral as arch "llama" with permuted Q/K and
stacked experts, Qwen3-MoE with stacked experts and no norm_topk_prob key), each loaded by
tessera and checked against the original Hugging Face model: the same greedy tokens and the
same log-probabilities (float32)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import VOCAB, check_greedy_and_logprobs
from tests.weights.gguf_writer import write_model_gguf

NEW_TOKENS = 10
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.1)

pytestmark = pytest.mark.usefixtures("one_thread")


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # llama.cpp scales queries by head_dim ** -0.5 (the file has no query_pre_attn_scalar)
    cfg = Gemma2Config(**COMMON, intermediate_size=128, head_dim=32, query_pre_attn_scalar=32,
                       sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                       attn_implementation="eager")
    return Gemma2ForCausalLM(cfg)


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # six layers: llama.cpp's pattern makes the sixth the only full-attention (global) layer
    cfg = Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, intermediate_size=128, head_dim=32,
                           query_pre_attn_scalar=32, sliding_window=8, attn_implementation="eager",
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 100.0}})
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types.count("full_attention") == 1
    return Gemma3ForCausalLM(cfg)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    # head_dim 32, not hidden / heads (16): it must survive the LlamaConfig -> MixtralConfig turn
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4, head_dim=32,
                                            num_experts_per_tok=2, tie_word_embeddings=False))


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # llama.cpp renormalises Qwen3-MoE's top-k weights whatever the checkpoint said
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                                              head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=True, tie_word_embeddings=False))


def minimax_m2():
    """Whole-projection query / key norms, half-head rotary (the file's rope.dimension_count),
    sigmoid routing with a drawn correction bias (exp_probs_b.bias)."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**COMMON, intermediate_size=32, head_dim=16, rotary_dim=8,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 tie_word_embeddings=False))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(0.5 * torch.randn(layer.mlp.gate.weight.shape, generator=g))
            layer.mlp.e_score_correction_bias.copy_(0.3 * torch.randn(4, generator=g))
    return model


def phi3(longrope: bool = False):
    from transformers import Phi3Config, Phi3ForCausalLM

    extra = dict(max_position_embeddings=512, original_max_position_embeddings=512)
    if longrope:  # short factors apply up to 32 tokens; the prompts below cross it
        g = torch.Generator().manual_seed(3)
        extra = dict(max_position_embeddings=512, original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "long_factor": (1 + 3 * torch.rand(8, generator=g)).tolist(),
            "short_factor": (1 + 0.5 * torch.rand(8, generator=g)).tolist()})
    return Phi3ForCausalLM(Phi3Config(**{**COMMON, **extra}, intermediate_size=64, sliding_window=None,
                                      tie_word_embeddings=False))


def smollm3():
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    # four layers: the fourth is a NoPE layer, which the file does not say (llama.cpp knows)
    cfg = SmolLM3Config(**{**COMMON, "num_hidden_layers": 4}, intermediate_size=128, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    assert cfg.no_rope_layers == [1, 1, 1, 0]
    return SmolLM3ForCausalLM(cfg)


def granite(**extra):
    """Granite's four multipliers far from 1 (a missed one moves every logit), biases."""
    from transformers import GraniteConfig, GraniteForCausalLM

    multipliers = dict(embedding_multiplier=12.0, attention_multiplier=0.02, residual_multiplier=0.22,
                       logits_scaling=8.0)
    return GraniteForCausalLM(GraniteConfig(**COMMON, intermediate_size=64, **{**multipliers, **extra}))


def _granite_keys(cfg):
    """llama.cpp's names for Granite's multipliers (its converter renames them)."""
    def add(w):
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    return add


def olmo2(**extra):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**{**COMMON, **extra}, intermediate_size=64))


def glm4(**extra):
    from transformers import Glm4Config, Glm4ForCausalLM

    return Glm4ForCausalLM(Glm4Config(**{**COMMON, **extra}, intermediate_size=64, head_dim=16))


GRANITE_CONFIG = granite().config
CASES = {
    "gemma2": (gemma2, "gemma2", {}),
    "smollm3": (smollm3, "smollm3", {}),
    "smollm3-q8_0": (smollm3, "smollm3", {"qtype": QT.Q8_0}),
    "gemma3": (gemma3, "gemma3", {}),
    "mixtral": (mixtral, "llama", {}),
    "mixtral-per-expert": (mixtral, "llama", {"per_expert": True}),
    "qwen3moe": (qwen3_moe, "qwen3moe", {}),
    "qwen3moe-q8_0": (qwen3_moe, "qwen3moe", {"qtype": QT.Q8_0}),
    "qwen3moe-fused-gate-up": (qwen3_moe, "qwen3moe", {"fuse_gate_up": True}),
    "mixtral-fused-gate-up": (mixtral, "llama", {"fuse_gate_up": True}),
    "phi3": (phi3, "phi3", {}),
    # transformers reads its config; llama.cpp writes the rotary width as rope.dimension_count
    "minimax-m2": (minimax_m2, "minimax-m2", {"extra_metadata": lambda w: w.add_rope_dimension_count(8)}),
    "minimax-m2-q8_0": (minimax_m2, "minimax-m2", {"qtype": QT.Q8_0,
                                                   "extra_metadata": lambda w: w.add_rope_dimension_count(8)}),
    "granite": (granite, "granite", {"extra_metadata": _granite_keys(GRANITE_CONFIG)}),
    "olmo2": (olmo2, "olmo2", {}),
    # llama.cpp writes the rotary width (half of each head by default) as rope.dimension_count
    "glm4-bias": (glm4, "glm4", {"extra_metadata": lambda w: w.add_rope_dimension_count(8)}),
    "glm4-quarter-tied-q8_0": (lambda: glm4(partial_rotary_factor=0.25, tie_word_embeddings=True,
                                            attention_bias=False), "glm4",
                               {"qtype": QT.Q8_0, "extra_metadata": lambda w: w.add_rope_dimension_count(4)}),
    "olmo2-mha-tied-q8_0": (lambda: olmo2(num_key_value_heads=4, tie_word_embeddings=True), "olmo2",
                            {"qtype": QT.Q8_0}),
    "granite-tied-bias-q8_0": (lambda: granite(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
                               "granite", {"qtype": QT.Q8_0, "extra_metadata": _granite_keys(GRANITE_CONFIG)}),
}


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random norm weights (a loader that skips them, or mishandles Gemma's 1 + w, shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                centre = 0.2 if "gemma" in type(model).__name__.lower() else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def dequantized(model: torch.nn.Module, qtype: QT) -> torch.nn.Module:
    """The model holding what a `qtype` file stores: each 2-D+ weight quantized and back."""
    if qtype == QT.F32:
        return model
    import copy

    import gguf

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                a = p.detach().float().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)))
    return ref


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 40)]


@pytest.fixture(scope="module")
def tokenizer_json(tiny_tokenizer_dir) -> Path:
    return Path(tiny_tokenizer_dir) / "tokenizer.json"


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_gives_the_original_models_outputs(name, tokenizer_json, tmp_path):
    build, arch, options = CASES[name]
    torch.manual_seed(len(name))
    hf = randomised(build(), seed=len(name))
    path = write_model_gguf(tmp_path / f"{name}.gguf", hf, tokenizer_json, arch, **options)
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    config = llm.engine.router.config
    assert config.model_type == hf.config.model_type
    if arch == "smollm3":  # what llama.cpp runs, from no key of the file
        assert config.no_rope_layers == hf.config.no_rope_layers and config.tie_word_embeddings
        assert llm.engine.router.chat_template  # the file's, through the tokenizer
    check_greedy_and_logprobs(llm, dequantized(hf, options.get("qtype", QT.F32)), prompts(), NEW_TOKENS)


def test_phi3_longrope_factors_from_tensors(tokenizer_json, tmp_path):
    """Phi-3.5-style longrope: the factors travel as rope_factors_long / _short tensors and the
    attention factor as a key; prompts cross the original length, so both factor sets matter."""
    import gguf

    torch.manual_seed(4)
    hf = randomised(phi3(longrope=True), seed=4)
    params = hf.config.rope_parameters
    scale = hf.config.max_position_embeddings / hf.config.original_max_position_embeddings
    attn_factor = float(np.sqrt(1 + np.log(scale) / np.log(hf.config.original_max_position_embeddings)))
    original_write = gguf.GGUFWriter.write_header_to_file

    def with_longrope(self, *args, **kwargs):  # as Phi3MiniModel.generate_extra_tensors adds them
        self.add_rope_scaling_attn_factors(attn_factor)
        self.add_tensor("rope_factors_long.weight", np.array(params["long_factor"], dtype=np.float32))
        self.add_tensor("rope_factors_short.weight", np.array(params["short_factor"], dtype=np.float32))
        return original_write(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = with_longrope
    try:
        path = write_model_gguf(tmp_path / "phi3-longrope.gguf", hf, tokenizer_json, "phi3")
    finally:
        gguf.GGUFWriter.write_header_to_file = original_write
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    rope = llm.engine.router.config.rope_parameters
    assert rope["rope_type"] == "longrope"
    assert rope["long_factor"] == pytest.approx(params["long_factor"])
    check_greedy_and_logprobs(llm, hf, prompts(), NEW_TOKENS)


def test_gemma2_config_from_the_file(tokenizer_json, tmp_path):
    torch.manual_seed(5)
    hf = randomised(gemma2(), seed=5)
    path = write_model_gguf(tmp_path / "gemma2.gguf", hf, tokenizer_json, "gemma2")
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    cfg = llm.engine.router.config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 2.0)
    assert (cfg.query_pre_attn_scalar, cfg.sliding_window, cfg.head_dim) == (32, 8, 32)
    layer = llm.engine.model.model.layers[1]
    # tessera holds Gemma's norms as 1 + w: here exactly the file's stored values
    torch.testing.assert_close(layer.post_feedforward_layernorm.weight,
                               1 + hf.model.layers[1].post_feedforward_layernorm.weight, rtol=0, atol=1e-6)


def test_stacked_experts_are_dequantized_one_expert_at_a_time(tokenizer_json, tmp_path, monkeypatch):
    """A stacked ffn_*_exps tensor is dequantized a slice per expert (a whole Mixtral-8x7B one
    would be 1.9 GB of float32 in flight), and each slice is its own expert's weight."""
    import gguf.quants

    from tessera.models.qwen3_moe.router import Qwen3MoeRouter
    from tessera.weights.gguf import iter_gguf_weights

    torch.manual_seed(5)
    hf = qwen3_moe()
    path = write_model_gguf(tmp_path / "moe.gguf", hf, tokenizer_json, "qwen3moe", qtype=QT.Q8_0)
    stored_sizes: list[int] = []
    original = gguf.quants.dequantize

    def recording(data, qtype):
        stored_sizes.append(data.size)
        return original(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", recording)
    weights = dict(iter_gguf_weights(path, permute_qk=False, num_heads=4, num_kv_heads=2,
                                     names=Qwen3MoeRouter.gguf_names))
    cfg = hf.config
    one_expert = cfg.moe_intermediate_size * cfg.hidden_size * 34 // 32  # Q8_0: 34 bytes a block of 32
    assert max(stored_sizes) <= max(one_expert, cfg.vocab_size * cfg.hidden_size * 34 // 32)
    expert_sized = [n for n in stored_sizes if n == one_expert]
    assert len(expert_sized) >= 3 * cfg.num_experts * cfg.num_hidden_layers  # gate, up, down
    want = dequantized(hf, QT.Q8_0).model.layers[1].mlp.experts
    for e in range(cfg.num_experts):
        got = weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        torch.testing.assert_close(got, want.down_proj[e].detach(), rtol=0, atol=0)


def test_olmo3_gguf_is_refused_by_name(tokenizer_json, tmp_path):
    path = write_model_gguf(tmp_path / "olmo3.gguf", randomised(olmo2(), seed=1), tokenizer_json, "olmo2",
                            extra_metadata=lambda w: w.add_sliding_window(8))
    with pytest.raises(ValueError, match="OLMo 3 GGUF"):
        LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0])
def test_cohere2_gguf(qtype, tokenizer_json, tmp_path):
    """Command R7B's layout from llama.cpp's file: every fourth layer global (no key says so),
    the sliding window and logit scale from their keys, the LayerNorm's epsilon."""
    import gguf
    from transformers import Cohere2Config, Cohere2ForCausalLM

    from tests.weights.gguf_writer import add_decoder_keys, add_tokenizer, model_tensors, write_tensors

    cfg = Cohere2Config(**{**COMMON, "num_hidden_layers": 8}, intermediate_size=64, sliding_window=8,
                        logit_scale=0.25, layer_norm_eps=1e-4, tie_word_embeddings=True)
    hf = randomised(Cohere2ForCausalLM(cfg), seed=4)
    w = gguf.GGUFWriter(str(tmp_path / "cohere2.gguf"), "cohere2")
    add_decoder_keys(w, cfg)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_logit_scale(cfg.logit_scale)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    add_tokenizer(w, tokenizer_json, cfg.vocab_size)
    write_tensors(w, ((name, array, qtype if array.ndim >= 2 else QT.F32)
                      for name, array in model_tensors(hf, "cohere2").items()))
    llm = LLM(tmp_path / "cohere2.gguf", dtype="float32", num_kv_blocks=32, show_progress=False,
              cache_dir=tmp_path / "cache")
    config = llm.engine.router.config
    assert config.layer_types == hf.config.layer_types and config.layer_norm_eps == pytest.approx(1e-4)
    check_greedy_and_logprobs(llm, dequantized(hf, qtype), prompts(), NEW_TOKENS)


def test_granite_multipliers_the_file_leaves_out_take_llama_cpps_defaults(tokenizer_json, tmp_path):
    """The converter writes a multiplier only when the config sets it: a file without the
    attention, embedding and residual keys runs as llama.cpp runs it (1 / sqrt(head_dim), 1, 1)."""
    hf = randomised(granite(attention_multiplier=0.25, embedding_multiplier=1.0, residual_multiplier=1.0), seed=3)
    path = write_model_gguf(tmp_path / "granite.gguf", hf, tokenizer_json, "granite",
                            extra_metadata=lambda w: w.add_logit_scale(hf.config.logits_scaling))
    llm = LLM(path, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")
    assert llm.engine.router.config.attention_multiplier == pytest.approx(0.25)
    check_greedy_and_logprobs(llm, hf, prompts(), NEW_TOKENS)
