"""LoRA adapters on the other model folders, against PEFT on transformers' model: Gemma 2,
Mistral (sliding window), Phi-3, whose checkpoints (and so its adapters) target the fused
qkv_proj / gate_up_proj; Qwen2
(Q/K/V biases, which adapters leave alone) and Qwen3 (Q/K norms after the adapted
projection); Mixtral's, Qwen3-MoE's and gpt-oss's attention, with adapters on experts
refused; and tensor
parallelism, where every kind of target is split over two ranks."""
from __future__ import annotations

import functools

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.engine.engine import RequestError
from tessera.lora import LoRARequest
from tests.lora.peft_adapters import save_peft_adapter
from tests.models.parity import hf_generate, make_tiny, prompt_ids
from tests.models.families import make_family
from tests.models.test_bamba import make_tiny_bamba
from tests.models.test_deepseek import make_tiny_deepseek
from tests.models.test_glm4_moe import CASES as GLM4_MOE_CASES
from tests.models.test_glm4_moe import make_tiny_glm4_moe
from tests.models.test_ernie4_5 import MOE as ERNIE_MOE
from tests.models.test_ernie4_5 import make_tiny_ernie
from tests.models.test_minimax_m2 import make_tiny_minimax_m2
from tests.models.test_falcon_h1 import make_tiny_falcon_h1
from tests.models.test_gpt_oss import make_tiny_gpt_oss
from tests.models.test_granite_hybrid import make_tiny_granite_hybrid
from tests.models.test_mistral4 import CASES as MISTRAL4_CASES
from tests.models.test_mistral4 import make_tiny_mistral4
from tests.models.test_lfm2 import make_tiny_lfm2
from tests.models.test_moe_parity import make_tiny_moe
from tests.models.test_nemotron_h import make_tiny_nemotron_h
from tests.models.test_phi3_parity import make_tiny_phi3
from tests.models.test_qwen3_next import make_tiny_qwen3_next
from tests.models.test_qwen_parity import make_tiny_qwen

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 16
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
PROMPTS = [prompt_ids(n, seed=5) for n in (4, 19, 37)]

def make_tiny_gemma2(folder, tokenizer_dir, seed: int = 0):
    """Gemma 2 (softcaps, sliding window, sandwich norms), as its parity test makes it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.models.test_gemma2_parity import BASE as GEMMA2
    return make_tiny(folder, tokenizer_dir, Gemma2Config, Gemma2ForCausalLM, seed=seed, base=GEMMA2,
                     attn_implementation="eager")


def make_tiny_gemma4(folder, tokenizer_dir, seed: int = 0, case: str = "e2b"):
    from tests.models.test_gemma4 import make
    return make(folder, tokenizer_dir, case)


def make_tiny_gemma4_released(folder, tokenizer_dir, seed: int = 0):
    from tests.models.test_gemma4 import make_released
    return make_released(folder, tokenizer_dir, seed)


def make_tiny_gemma3(folder, tokenizer_dir, seed: int = 0):
    """Gemma 3 (head norms, a rotary table per layer type), as its parity test makes it."""
    from tests.models.test_gemma3_parity import make
    return make(folder, tokenizer_dir, "gemma3-tied")


def make_tiny_mistral(folder, tokenizer_dir, seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM

    return make_tiny(folder, tokenizer_dir, MistralConfig, MistralForCausalLM, seed=seed, sliding_window=8)


# name -> (model maker, its kind argument or None, adapter target modules)
FAMILIES = {
    "phi3-fused": (make_tiny_phi3, None, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qwen2-biased-qkv": (make_tiny_qwen, "qwen2", ["q_proj", "k_proj", "v_proj", "up_proj"]),
    "qwen3-qk-norm": (make_tiny_qwen, "qwen3", ["q_proj", "k_proj", "o_proj", "down_proj"]),
    "mixtral-attention": (make_tiny_moe, "mixtral", ["q_proj", "v_proj", "o_proj"]),
    "qwen3-moe-attention": (make_tiny_moe, "qwen3_moe", ["q_proj", "k_proj", "o_proj"]),
    "gpt-oss-attention": (make_tiny_gpt_oss, None, ["q_proj", "v_proj", "o_proj"]),  # biased, with sinks
    # MLA's projections around the latent cache (kv_b_proj, absorbed, is refused below)
    "deepseek-v3-mla": (functools.partial(make_tiny_deepseek, kind="deepseek_v3", q_lora_rank=24, n_group=2,
                                          topk_group=1), None, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),
    "deepseek-v2-lite": (functools.partial(make_tiny_deepseek, kind="deepseek_v2", q_lora_rank=None),
                         None, ["q_proj", "kv_a_proj_with_mqa", "o_proj"]),
    # biased Q / K / V with head norms (PEFT targets the experts' stacks with any MLP name)
    "glm4-moe-lite-mla": (functools.partial(make_tiny_deepseek, kind="glm4_moe_lite", q_lora_rank=24,
                                            mlp_layer_types=["dense", "sparse", "sparse"]), None,
                          ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),
    "glm4-moe": (functools.partial(make_tiny_glm4_moe, **GLM4_MOE_CASES["qk-norm-groups"]), None,
                 ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "ernie4.5-biased": (functools.partial(make_tiny_ernie, kind="ernie4_5", use_bias=True), None,
                        ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"]),
    "ernie4.5-moe-attention": (functools.partial(make_tiny_ernie, kind="ernie4_5_moe", **ERNIE_MOE), None,
                               ["q_proj", "v_proj", "o_proj"]),
    "minimax-m2": (make_tiny_minimax_m2, None, ["q_proj", "k_proj", "o_proj"]),  # (before the whole-projection norms)
    # Gated DeltaNet's projections (Qwen3.5's separate ones, Qwen3-Next's grouped by key head)
    # and gated attention's q_proj, each head's query then gate: B's rows are regrouped too
    "qwen3.5-hybrid": (functools.partial(make_tiny_qwen3_next, "qwen3_5_text"), None,
                       ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "down_proj"]),
    "qwen3-next-hybrid": (functools.partial(make_tiny_qwen3_next, "qwen3_next"), None,
                          ["q_proj", "v_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]),
    # Mamba-2's packed in_proj and its out_proj, NoPE attention, the shared MLP (experts refused)
    "granite-4.0-h": (functools.partial(make_tiny_granite_hybrid, "granite-4.0-h-moe-nope"), None,
                      ["in_proj", "out_proj", "q_proj", "v_proj", "input_linear"]),
    "bamba": (functools.partial(make_tiny_bamba, "bamba-two-groups"), None,
              ["in_proj", "out_proj", "q_proj", "v_proj", "up_proj"]),
    "mistral4-mla": (functools.partial(make_tiny_mistral4, **MISTRAL4_CASES["yarn-temperature-qlora"]), None,
                     ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),
    "nemotron-h": (functools.partial(make_tiny_nemotron_h, "nemotron-h-one-group"), None,
                   ["in_proj", "k_proj", "o_proj", "up_proj", "down_proj"]),  # (PEFT refuses Mamba's out_proj here)
    # LFM2's short convolution's packed in_proj and out_proj, attention, its w1 / w3 / w2 MLP
    "lfm2": (functools.partial(make_tiny_lfm2, "lfm2-biased-conv"), None, ["in_proj", "out_proj", "q_proj", "w1", "w2"]),
    "lfm2-moe": (functools.partial(make_tiny_lfm2, "lfm2-moe"), None, ["in_proj", "k_proj", "w3", "w2"]),
    "falcon-h1": (functools.partial(make_tiny_falcon_h1, "falcon-h1-norm-then-gate"), None,
                  ["in_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]),  # (PEFT refuses Mamba's out_proj here)
    "gemma2": (make_tiny_gemma2, None, ["q_proj", "o_proj", "gate_proj", "down_proj"]),
    "gemma3": (make_tiny_gemma3, None, ["q_proj", "k_proj", "up_proj", "down_proj"]),
    # KV-shared layers' q_proj, the full layers' k_proj that is also their v_proj (moe), PLE's gate
    "gemma4-e2b": (functools.partial(make_tiny_gemma4, case="e2b"), None,
                   ["q_proj", "v_proj", "o_proj", "per_layer_input_gate", "down_proj"]),
    "gemma4-moe": (functools.partial(make_tiny_gemma4, case="moe"), None, ["q_proj", "k_proj", "o_proj", "up_proj"]),
    # (a pattern: the vision tower's projections are not nn.Linear, PEFT refuses them)
    "gemma4-released": (make_tiny_gemma4_released, None, r".*language_model.*\.(q_proj|k_proj|gate_proj)"),
    "mistral-sliding": (make_tiny_mistral, None, ["k_proj", "v_proj", "up_proj"]),
    **{f"{case}-family": (functools.partial(make_family, name=case), None, targets) for case, targets in (
        ("smollm3-alternate-tied", ["q_proj", "k_proj", "o_proj", "gate_proj"]),
        ("olmo2-gqa", ["q_proj", "k_proj", "v_proj", "down_proj"]),
        ("olmo3-window8-yarn", ["q_proj", "o_proj", "up_proj"]),
        ("ministral3-yarn-temperature", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
        ("granite-gqa", ["k_proj", "o_proj", "up_proj", "down_proj"]),
        ("glm4-gqa-bias", ["q_proj", "v_proj", "gate_up_proj", "down_proj"]),
        ("cohere2-window8-tied", ["q_proj", "k_proj", "o_proj", "up_proj"]))},
}


def _make(family: str, tmp_path_factory, tokenizer_dir):
    maker, kind, targets = FAMILIES[family]
    folder = tmp_path_factory.mktemp(family)
    hf = maker(folder, tokenizer_dir, seed=3) if kind is None else maker(folder, tokenizer_dir, kind, seed=3)
    adapter = tmp_path_factory.mktemp(f"{family}-adapter")
    peft_model = save_peft_adapter(hf, adapter, seed=4, std=0.2, target_modules=targets)
    return folder, hf, adapter, peft_model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_outputs_equal_pefts(family, tmp_path_factory, tiny_tokenizer_dir):
    folder, hf, adapter, peft_model = _make(family, tmp_path_factory, tiny_tokenizer_dir)
    expected = [hf_generate(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    assert expected != [hf_generate(hf, p, NEW_TOKENS) for p in PROMPTS], "the adapter must matter"
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, enable_lora=True) as llm:
        lora = LoRARequest(family, 1, str(adapter))
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)]
        assert got == expected
        base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in base] == [hf_generate(hf, p, NEW_TOKENS) for p in PROMPTS]


def test_mixtral_experts_are_refused(tmp_path_factory, tiny_tokenizer_dir):
    folder = tmp_path_factory.mktemp("mixtral")
    hf = make_tiny_moe(folder, tiny_tokenizer_dir, "mixtral", seed=3)
    adapter = tmp_path_factory.mktemp("mixtral-experts")
    # transformers 5 stores the experts as stacked parameters, which PEFT targets as such
    save_peft_adapter(hf, adapter, seed=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    with LLM(folder, dtype="float32", num_kv_blocks=32, show_progress=False, enable_lora=True) as llm:
        with pytest.raises(RequestError, match=r"target_parameters=\['experts.gate_up_proj'\] is not supported"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("x", 1, str(adapter)))
        assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("family", ["phi3-fused", "qwen2-biased-qkv", "qwen3-next-hybrid", "granite-4.0-h",
                                    "nemotron-h", "lfm2"])
def test_tensor_parallel_adapters_equal_one_process(family, tmp_path_factory, tiny_tokenizer_dir):
    folder, _, adapter, peft_model = _make(family, tmp_path_factory, tiny_tokenizer_dir)
    expected = [hf_generate(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    loras = [LoRARequest("a", 1, str(adapter)), None, LoRARequest("a", 1, str(adapter))]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, enable_lora=True,
             tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)]
    assert got[0] == expected[0] and got[2] == expected[2]
    assert got[1] != expected[1]  # the base model's row is not adapted


def test_adapters_apply_on_int8_weights(tmp_path_factory, tiny_tokenizer_dir):
    """The delta adds to whatever the base layer computes: with int8 base weights the
    adapter's output is the int8 model's plus the adapter (close to PEFT's, not equal)."""
    folder, hf, adapter, peft_model = _make("qwen2-biased-qkv", tmp_path_factory, tiny_tokenizer_dir)
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, enable_lora=True,
             quantization="int8") as llm:
        lora = LoRARequest("a", 1, str(adapter))
        params = SamplingParams(max_new_tokens=1, temperature=0, logprobs=5)
        out = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    for prompt, o in zip(PROMPTS, out):
        with torch.no_grad():
            want = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        token = o.outputs[0].token_ids[0]
        assert abs(o.outputs[0].logprobs[0][token].logprob - want[token].item()) < 0.05


def test_adapters_apply_on_int4_weights(tmp_path_factory, tiny_tokenizer_dir):
    """With int4 base weights (the LM head in int8) the adapter adds to what the quantized
    layers compute: PEFT with its base weights replaced by the dequantized ones."""
    from tessera.ops.linear_int4 import dequantize_int4, quantize_int4
    from tessera.ops.linear_int8 import quantize_int8

    folder, hf, adapter, peft_model = _make("qwen2-biased-qkv", tmp_path_factory, tiny_tokenizer_dir)
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lora_" not in name:
                w = module.weight.data.float()
                if name.endswith("lm_head"):
                    q, s = quantize_int8(w)
                    module.weight.copy_(q.float() * s.unsqueeze(1))
                else:
                    module.weight.copy_(dequantize_int4(*quantize_int4(w)))
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, enable_lora=True,
             quantization="int4") as llm:
        assert llm.engine.model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
        lora = LoRARequest("a", 1, str(adapter))
        params = SamplingParams(max_new_tokens=1, temperature=0, logprobs=5)
        out = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    for prompt, o in zip(PROMPTS, out):
        with torch.no_grad():
            want = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        token = o.outputs[0].token_ids[0]
        assert token == int(want.argmax())
        assert abs(o.outputs[0].logprobs[0][token].logprob - want[token].item()) < 1e-3


def test_bf16_adapters_follow_pefts_float32_outputs(tmp_path_factory, tiny_tokenizer_dir):
    """In bf16 the slots' GEMMs run through the CPU's packed bf16 kernel where it builds
    (zero-padded ranks): the adapter's effect on the next-token distribution must be
    PEFT's, within bf16 rounding."""
    folder, hf, adapter, peft_model = _make("qwen2-biased-qkv", tmp_path_factory, tiny_tokenizer_dir)
    params = SamplingParams(max_new_tokens=1, temperature=0, logprobs=0)
    with LLM(folder, dtype="bfloat16", num_kv_blocks=64, show_progress=False, enable_lora=True) as llm:
        slots = llm.engine.runner.lora.layers["model.layers.0.self_attn.qkv_proj"]
        out = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
        base = llm.generate(PROMPTS, params, use_tqdm=False)
    assert slots.a.shape[1] % 16 == 0 and slots.factors[0] is not None
    for prompt, o, b in zip(PROMPTS, out, base):
        with torch.no_grad():
            want = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
            want_base = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        token, base_token = o.outputs[0].token_ids[0], b.outputs[0].token_ids[0]
        assert abs(o.outputs[0].logprobs[0][token].logprob - want[token].item()) < 0.1
        assert abs(want[token].item() - want.max().item()) < 0.1  # (near-)greedy under PEFT too
        assert abs(b.outputs[0].logprobs[0][base_token].logprob - want_base[base_token].item()) < 0.1


def test_tensor_parallel_ranks_take_the_drivers_factors(tmp_path_factory, tiny_tokenizer_dir):
    """The other ranks receive the adapter the driver loaded; they never read its folder,
    so a folder removed (or rewritten) after loading changes nothing."""
    import shutil

    folder, _, adapter, peft_model = _make("qwen2-biased-qkv", tmp_path_factory, tiny_tokenizer_dir)
    copy = tmp_path_factory.mktemp("doomed") / "adapter"
    shutil.copytree(adapter, copy)
    expected = [hf_generate(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, enable_lora=True,
             tensor_parallel_size=2) as llm:
        llm.engine.add_lora(LoRARequest("a", 1, str(copy)))
        shutil.rmtree(copy)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request="a")]
    assert got == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_adapters_equal_pefts_with_base_steps_in_cuda_graphs(tmp_path_factory, tiny_tokenizer_dir):
    """On the GPU: adapter rows (eager steps, torch's lora_rows and segment GEMMs) equal
    PEFT's float32 greedy tokens in a batch with base-model rows; steps of base rows only
    still replay CUDA graphs."""
    folder, hf, adapter, peft_model = _make("qwen2-biased-qkv", tmp_path_factory, tiny_tokenizer_dir)
    loras = [LoRARequest("a", 1, str(adapter)), None, LoRARequest("a", 1, str(adapter))]
    with LLM(folder, dtype="float32", device="cuda", num_kv_blocks=64, show_progress=False,
             enable_lora=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)]
        assert llm.engine.runner.graphs is not None
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got[0] == hf_generate(peft_model, PROMPTS[0], NEW_TOKENS)
    assert got[2] == hf_generate(peft_model, PROMPTS[2], NEW_TOKENS)
    assert got[1] == base[1] == hf_generate(hf, PROMPTS[1], NEW_TOKENS)



def test_lora_is_claimed_by_the_tested_folders_only(tiny_tokenizer_dir, make_tiny_llama):
    """`tessera models` says LORA for exactly the folders tested here and in
    test_lora_engine.py (llama); the transformers fallback refuses it at start-up."""
    from tessera.config import ConfigError
    from tessera.models.registry import router_classes

    tested = {"llama", "phi3", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "gemma3", "mistral",
              "smollm3", "olmo2", "olmo3", "ministral3", "granite", "glm4", "cohere2", "gpt_oss",
              "deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe", "glm4_moe_lite", "minimax_m2", "ernie4_5", "ernie4_5_moe", "bamba", "qwen3_5_text", "qwen3_next", "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "falcon_h1",
              "qwen3_5_moe_text", "gemma4_text", "gemma4",  # (Qwen3-Next's router and model: the qwen3-next-hybrid case)
              "llava", "llava_next", "idefics3", "smolvlm", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
              "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}  # these and gemma3: tests/multimodal
    assert {t for t, r in router_classes().items() if r.features()["supports_lora"]} == tested
    folder, _ = make_tiny_llama()
    with pytest.raises(ConfigError, match="does not support LoRA adapters"):
        LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, enable_lora=True,
            model_impl="transformers")


def test_deepseek_kv_b_proj_adapters_are_refused(tmp_path_factory, tiny_tokenizer_dir):
    """kv_b_proj is absorbed into MLA's query and output (no layer applies it): an adapter
    of it is refused by name, and the engine goes on."""
    folder = tmp_path_factory.mktemp("deepseek")
    hf = make_tiny_deepseek(folder, tiny_tokenizer_dir, kind="deepseek_v2", q_lora_rank=None, seed=3)
    adapter = tmp_path_factory.mktemp("deepseek-kv-b")
    save_peft_adapter(hf, adapter, seed=4, target_modules=["kv_b_proj"])
    with LLM(folder, dtype="float32", num_kv_blocks=32, show_progress=False, enable_lora=True) as llm:
        with pytest.raises(RequestError, match="kv_b_proj"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("x", 1, str(adapter)))
        assert not llm.engine.has_unfinished()
