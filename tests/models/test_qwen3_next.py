"""Tessera's Qwen3.5 (dense), Qwen3-Next and Qwen3.5-MoE against transformers on tiny random
checkpoints: Gated DeltaNet layers (two value heads per key head, a decay and write strength
drawn to matter) between gated full-attention layers, partial rotary, (1 + w) norms, and for
the MoE variants routed experts with a sigmoid-gated shared expert (Qwen3-Next with one
dense layer off its sparse grid).

The recurrent state is what can go wrong here beyond the layers' arithmetic: it must carry
over between a sequence's prefill chunks and decodes, stay apart between sequences of one
batch, start from zero for a new or preempted sequence, and come back to the pool."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import ConfigError
from tessera.ops.linear_attention import GatedDeltaRule

from tests.models.parity import (VOCAB, Case, RecurrentParity, check_beam_search, check_bf16_close, hf_generate,
                                 hf_logits, make_tiny, prompt_ids, recurrent_case)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CASES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
}


def _drawn_gates(model: torch.nn.Module, g: torch.Generator) -> None:
    """Decays from fast to slow (A_log, dt_bias) and routers at scales that matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g) - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def make_tiny_qwen3_next(kind: str, folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers

    config_name, model_name, extra = CASES[kind]
    return make_tiny(folder, tokenizer_dir, getattr(transformers, config_name), getattr(transformers, model_name),
                     seed=seed, base={**BASE, **extra}, tweak=_drawn_gates, **overrides)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return recurrent_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make_tiny_qwen3_next, NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def cached(case: Case) -> LLM:
    """The same model as `case`, with prefix caching (the default)."""
    return LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)


def test_layers_and_state(case: Case, cached: LLM):
    """Linear layers hold the recurrent core, attention layers the KV cache; the state has
    a slot per max_num_seqs, as many again for prefix-cache snapshots, and one spare slot
    for the padded rows of the CPU decode graphs."""
    engine = cached.engine
    layers = engine.runner.model.model.layers
    assert [layer.is_linear for layer in layers] == [True, False, True, False]
    assert len(engine.runner.attn_layers) == 2 and len(engine.runner.state_layers) == 2
    conv_state, recurrent = layers[0].linear_attn.core.state
    slots = engine.config.scheduler.max_num_seqs
    assert conv_state.shape == (2 * slots + 1, 2 * 2 * 16 + 4 * 8, 3) and recurrent.shape == (2 * slots + 1, 4, 16, 8)
    assert engine.runner.num_state_slots == 2 * slots and engine.runner.graphs.state_pad_slot == 2 * slots
    assert recurrent.dtype == torch.float32
    assert engine.block_manager.enable_prefix_caching and engine.scheduler.state_cache.num_slots == slots
    torch.testing.assert_close(layers[0].linear_attn.A_log, case.hf.model.layers[0].linear_attn.A_log)
    core = engine.runner.state_layers[0]
    assert isinstance(core, GatedDeltaRule) and (core.num_k_heads, core.num_v_heads) == (2, 4)


def test_prefix_cache_restores_the_state_at_a_block_boundary(case: Case, cached: LLM):
    """A conversation's second turn (its first turn's prompt and reply, then more) and a
    prompt sharing another's first 40 tokens start from the cached prefix, their recurrent
    state restored from the snapshot at its last block boundary; their tokens equal
    transformers' and an engine's without prefix caching."""
    llm = cached
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first = prompt_ids(37, seed=21)
    reply = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    blocks = llm.engine.block_manager
    hits = blocks.prefix_hits
    second = first + reply + prompt_ids(9, seed=22)  # 66 tokens: the first turn's 57 cover 3 blocks
    shared = first[:40] + prompt_ids(12, seed=23)    # the first prompt's 2 full blocks
    outs = llm.generate([second], params, use_tqdm=False) + llm.generate([shared], params, use_tqdm=False)
    assert blocks.prefix_hits - hits == 48 + 32
    for prompt, out in zip((second, shared), outs):
        assert out.outputs[0].token_ids == hf_generate(case.hf, prompt, 20)
    uncached = case.llm
    assert uncached.engine.scheduler.state_cache is None
    assert [o.outputs[0].token_ids for o in uncached.generate([second, shared], params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]


def test_snapshots_survive_a_small_pool(case: Case):
    """Two running sequences and two snapshot slots: saves evict each other's snapshots,
    and every admission restores only what is still there; the tokens stay exact."""
    llm = LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=2, show_progress=False)
    base = prompt_ids(35, seed=31)
    prompts = [base + prompt_ids(5 + i, seed=40 + i) for i in range(5)]
    params = SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.block_manager.prefix_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(case.hf, p, 18) for p in prompts]
    cache = llm.engine.scheduler.state_cache
    assert len(cache.free) + len(cache.by_hash) == cache.num_slots  # every slot accounted for


def test_prompt_logprobs_match(case: Case):
    prompt = prompt_ids(70, seed=8)
    out = case.llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    want = hf_logits(case.hf, prompt).log_softmax(-1)
    got = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    expected = want[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert (got - expected).abs().max() < 1e-4


def test_preempted_sequences_restart_their_state(tmp_path, tiny_tokenizer_dir):
    """Six blocks of 16 tokens for three 40-token prompts growing to 72: sequences are
    preempted and recomputed; a recomputed sequence's state starts over, so the tokens still
    equal transformers'."""
    hf = make_tiny_qwen3_next("qwen3_5_text", tmp_path / "m", tiny_tokenizer_dir, seed=3)
    llm = LLM(tmp_path / "m", dtype="float32", num_kv_blocks=8, show_progress=False)
    prompts = [prompt_ids(40, seed=s) for s in (11, 12, 13)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 32) for p in prompts]
    assert len(llm.engine.scheduler.free_state_slots) == llm.engine.config.scheduler.max_num_seqs


def test_parallel_samples_keep_their_own_state(case: Case):
    """n = 3 seeded samples of one prompt: each is the same as that seed's request alone
    (siblings run together without sharing a state slot)."""
    prompt = prompt_ids(30, seed=9)
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    together = [c.token_ids for c in case.llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    alone = [case.llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert together == alone and len({tuple(t) for t in together}) > 1


def test_bf16_stays_close(case: Case):
    """bf16 weights, activations and conv state (the delta-rule state stays float32)."""
    llm = check_bf16_close(case.folder, case.hf, NUM_KV_BLOCKS, prompt_len=80, new_tokens=8)
    assert llm.engine.runner.state_layers[0].state[0].dtype == torch.bfloat16

def test_speculative_decoding_is_refused(case: Case):
    with pytest.raises(ConfigError, match="speculative decoding is not supported"):
        LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_decay_matters(case: Case):
    """Guards the fixture: with every linear layer's decay rate (A_log) changed,
    transformers' logits move far past the tolerance, so the parity above holds only because
    tessera's recurrence reads it."""
    prompt = prompt_ids(40, seed=5)
    before = hf_logits(case.hf, prompt)
    layer = case.hf.model.layers[0].linear_attn
    saved = layer.A_log.detach().clone()
    try:
        with torch.no_grad():
            layer.A_log.add_(2.0)
        assert (hf_logits(case.hf, prompt) - before).abs().max() > 1e-2
    finally:
        with torch.no_grad():
            layer.A_log.copy_(saved)




def test_inspect_reports_the_state(case: Case):
    from tessera.config import ModelConfig
    from tessera.inspection import format_report, inspect_model

    info = inspect_model(ModelConfig(model=str(case.folder), dtype="float32"), load=False)
    conv, matrix = (2 * 2 * 16 + 4 * 8) * 3 * 4, 4 * 16 * 8 * 4
    assert info["recurrent_state"] == {"layers": 2, "bytes_per_sequence": 2 * (conv + matrix)}
    assert info["kv_cache"]["attention_layers"] == 2
    assert "2 recurrent (linear attention) layers" in format_report(info)


def test_snapshot_copies_reach_every_rank(case: Case):
    """Tensor parallelism: each rank holds its heads' states, so the snapshot copies
    (restores before a step, saves after) go to every rank with the step; a second turn
    restored from a snapshot gives one process's tokens; a beam's fork copies its parent's
    state on every rank."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = prompt_ids(37, seed=51)
    with LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=2,
             show_progress=False) as two:
        reply = two.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
        second = first + reply + prompt_ids(7, seed=52)
        hits = two.engine.block_manager.prefix_hits
        got = two.generate([second], params, use_tqdm=False)[0].outputs[0].token_ids
        assert two.engine.block_manager.prefix_hits - hits == 48
        check_beam_search(two, case.hf)  # beams' forked states too
    assert got == hf_generate(case.hf, second, 12)


def test_async_scheduling_with_preemption(tmp_path, tiny_tokenizer_dir):
    """Async scheduling launches a step before the previous one's tokens are read; with too
    few blocks, sequences are preempted while steps are in flight. States, slots and
    snapshots still give transformers' tokens."""
    hf = make_tiny_qwen3_next("qwen3_5_text", tmp_path / "m", tiny_tokenizer_dir, seed=4)
    llm = LLM(tmp_path / "m", dtype="float32", num_kv_blocks=10, async_scheduling=True, show_progress=False)
    prompts = [prompt_ids(n, seed=s) for n, s in ((37, 1), (60, 2), (15, 3), (40, 4))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 24) for p in prompts]
    cache = llm.engine.scheduler.state_cache
    assert len(cache.free) + len(cache.by_hash) == cache.num_slots


def test_beam_search_forks_the_state(case: Case, cached: LLM):
    """Beams fork the gated delta rule's state and the convolution's, with prefix caching's
    snapshots (`cached`) and without; every state slot and snapshot comes back."""
    for llm in (case.llm, cached):
        check_beam_search(llm, case.hf)
        scheduler = llm.engine.scheduler
        assert sorted(scheduler.free_state_slots) == list(range(llm.engine.config.scheduler.max_num_seqs))
        assert llm.engine.block_manager.all_free()


class TestParity(RecurrentParity):
    def test_greedy_matches_hf_generate_alone_and_batched(self, case: Case):
        super().test_greedy_matches_hf_generate_alone_and_batched(case)
        scheduler = case.llm.engine.scheduler
        assert sorted(scheduler.free_state_slots) == list(range(case.llm.engine.config.scheduler.max_num_seqs))
