"""Decoder layers hand their input norms to the linears that read them where an
`rms_norm_linear` builder exists (CUDA's few-row linear normalises rows as it loads them:
tessera/ops/pending_norm.py). No CPU builder does, so these tests register one (the norm's
reference op, then the linear) and check which layers take that path, that they still
give transformers' tokens and logits, and that a linear which cannot fuse (LoRA) computes
the norm first."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera import LLM, SamplingParams
from tessera.ops import registry
from tessera.ops.norm import RMSNorm, rms_norm_ref
from tessera.ops.pending_norm import PendingNorm, input_to_one_linear
from tessera.ops.registry import register_op, select_op

from tests.models.parity import FP32_ATOL, hf_generate, hf_logits, make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def norm_linear_calls():
    """A CPU rms_norm_linear builder for this test; yields the row counts it was called with."""
    builders = {kind: list(entries) for kind, entries in registry._BUILDERS.items()}
    selections = list(registry._SELECTIONS)
    calls: list[int] = []

    def norm_then_linear(x, residual, norm_weight, eps, weight, bias):
        calls.append(x.shape[0])
        normed, summed = rms_norm_ref(x, norm_weight, eps, residual)
        return F.linear(normed, weight, bias), x if summed is None else summed

    register_op("rms_norm_linear", name="test_norm_then_linear", priority=100, devices=("cpu",),
                dtypes=(torch.float32,))(norm_then_linear)
    try:
        yield calls
    finally:
        registry._BUILDERS.clear()
        registry._BUILDERS.update(builders)
        registry._SELECTIONS[:] = selections
        select_op.cache_clear()


def _layers(llm: LLM) -> list[nn.Module]:
    return list(llm.engine.runner.model.model.layers)


def _make(family: str, folder, tokenizer_dir) -> nn.Module:
    """A tiny checkpoint of `family`; Gemma 2 / 3 with their float32 (1 + w) norm weights,
    pre- and post-norms, soft-capping and sliding windows."""
    if family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        from tests.models.test_gemma2_parity import BASE
        return make_tiny(folder, tokenizer_dir, Gemma2Config, Gemma2ForCausalLM, seed=5, base=BASE,
                         attn_implementation="eager")
    if family == "gemma3":
        from tests.models.test_gemma3_parity import make
        return make(folder, tokenizer_dir, "gemma3-untied-softcap")
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    return make_tiny(folder, tokenizer_dir, config, model, seed=5, **({"head_dim": 16} if family == "qwen3" else {}))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_layers_fuse_their_norms_and_match_transformers(family, norm_linear_calls, tmp_path, tiny_tokenizer_dir):
    hf = _make(family, tmp_path, tiny_tokenizer_dir)
    prompts = [[5, 9, 31, 7, 100, 42], [17, 3, 250]]
    with LLM(str(tmp_path), dtype="float32", enforce_eager=True, show_progress=False) as llm:
        assert all(layer.norms_into_linears for layer in _layers(llm))
        norm_linear_calls.clear()
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    prompt_logprobs=0), use_tqdm=False)
    # two norms a layer, every pass: the prompts' rows, then one row a sequence a step
    assert norm_linear_calls and len(norm_linear_calls) % (2 * len(hf.model.layers)) == 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, 6)
        want = torch.log_softmax(hf_logits(hf, prompt), -1)
        got = [entry[prompt[i + 1]].logprob for i, entry in enumerate(out.prompt_logprobs[1:])]
        torch.testing.assert_close(torch.tensor(got), want[torch.arange(len(prompt) - 1), prompt[1:]],
                                   atol=FP32_ATOL, rtol=0)


def test_without_a_builder_layers_norm_first(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=2)
    with LLM(str(folder), dtype="float32", enforce_eager=True, show_progress=False) as llm:
        assert not any(layer.norms_into_linears for layer in _layers(llm))


def test_a_linear_with_lora_computes_the_norm_first(norm_linear_calls, make_tiny_llama):
    """LoRA's delta reads the normalised rows, so a layer with adapters does not fuse."""
    from tessera.models.llama.modeling import LlamaAttention

    folder, _ = make_tiny_llama(seed=3)
    with LLM(str(folder), dtype="float32", enforce_eager=True, show_progress=False) as llm:
        qkv = _layers(llm)[0].self_attn.qkv_proj
        assert isinstance(_layers(llm)[0].self_attn, LlamaAttention) and qkv.fuses_input_norm
        x, residual = torch.randn(3, qkv.in_features), torch.randn(3, qkv.in_features)
        norm = _layers(llm)[0].input_layernorm
        norm_linear_calls.clear()  # the warm-up's
        fused = PendingNorm(norm, x, residual)
        want = qkv(fused)
        assert norm_linear_calls == [3]
        qkv.lora = lambda rows, out: out + rows.sum()  # a stand-in adapter reading the rows
        try:
            plain = PendingNorm(norm, x, residual)
            got = qkv(plain)
        finally:
            qkv.lora = None
        assert norm_linear_calls == [3]  # not called again
        normed, summed = rms_norm_ref(x, norm.weight, norm.eps, residual)
        torch.testing.assert_close(got, want + normed.sum())
        assert torch.equal(plain.next_residual(), summed) and torch.equal(fused.next_residual(), summed)


def test_only_forwards_that_declare_it_take_a_pending_norm():
    from tessera.models.gemma2.modeling import Gemma2RMSNorm
    from tessera.models.llama.modeling import LlamaAttention, LlamaMLP
    from tessera.models.qwen3.modeling import Qwen3Attention

    class Overriding(LlamaAttention):
        def forward(self, rope, hidden):  # uses hidden beyond qkv_proj: must not inherit the claim
            return hidden

    class Inheriting(LlamaMLP):
        pass

    def bare(cls):
        return cls.__new__(cls)

    assert input_to_one_linear(bare(LlamaAttention)) and input_to_one_linear(bare(Qwen3Attention))
    assert input_to_one_linear(bare(Inheriting)) and not input_to_one_linear(bare(Overriding))
    assert not input_to_one_linear(nn.Linear(2, 2))

    class OffsetNorm(RMSNorm):  # computes otherwise than its weight and eps say
        def forward(self, x, residual=None):
            return super().forward(x + 1, residual)

    assert PendingNorm(bare(Gemma2RMSNorm), torch.zeros(1, 2), None).fusable
    assert not PendingNorm(bare(OffsetNorm), torch.zeros(1, 2), None).fusable
    with pytest.raises(RuntimeError, match="never computed"):
        PendingNorm(None, torch.zeros(1, 2), None).next_residual()
