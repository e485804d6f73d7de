"""Tessera's Gemma 4 (text) against transformers' Gemma4ForCausalLM on tiny random checkpoints,
one per release shape:
- "e2b": the small models' per-layer embeddings, KV sharing (the last two layers read the
  caches of layers 2 and 3) and double-wide MLPs on the shared layers;
- "moe": the 26B A4B's experts beside the dense MLP, full layers whose values are their keys
  (one global KV head), an untied head and a final soft-cap.
Both have a sliding window (8) shorter than prompt + generation, sliding layers with a 16-wide
head and full layers with a 32-wide one under proportional rope, and random layer scalars,
router scales and norms, so a skipped or misapplied piece changes the logits. Then the
released checkpoints' layout (Gemma4ForConditionalGeneration with vision and audio towers)
with text prompts; with images: tests/multimodal/test_gemma4.py."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.models.registry import router_classes
from tessera.ops.attention import Attention
from tests.models.parity import (VOCAB, Case, check_bf16_close, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, greedy, hf_generate, make_tiny, prompt_ids,
                                 tiny_case)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, FULL, SLIDING, FULL, SLIDING, FULL]
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 100.0}}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
            sliding_window=8, layer_types=LAYER_TYPES, rope_parameters=ROPE, hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=VOCAB)
CASES = {
    "e2b": dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True),
    "moe": dict(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=False, final_logit_softcapping=3.0),
}


def draw_scales(model: torch.nn.Module, g: torch.Generator) -> None:
    """Layer scalars (a buffer transformers saves) and router scales away from 1; query and
    key norms around 0.5, as Gemma 4 leaves scores unscaled: with weights around 1 a random
    model's scores reach ~20 and its softmax turns chaotic (bf16 rounding flips it)."""
    for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
        if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
            tensor.copy_(0.75 + 0.5 * torch.rand(tensor.shape, generator=g))
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensor.copy_(0.4 + 0.2 * torch.rand(tensor.shape, generator=g))


def make(folder, tokenizer_dir, name: str, **overrides):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return make_tiny(folder, tokenizer_dir, Gemma4TextConfig, Gemma4ForCausalLM, seed=len(name), base=BASE,
                     tweak=draw_scales, attn_implementation="eager", **{**CASES.get(name, {}), **overrides})


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    return tiny_case(request.param, tmp_path_factory, tiny_tokenizer_dir, make, NUM_KV_BLOCKS)


def test_checkpoint_has_what_the_case_claims(case: Case):
    model = case.llm.engine.runner.model
    assert type(model).__name__ == "Gemma4ForCausalLM"
    layers = model.model.layers
    attn = [layer.self_attn.attn for layer in layers]
    caches = [a for a in attn if isinstance(a, Attention)]
    assert caches == case.llm.engine.runner.attn_layers  # shared layers own no cache
    if case.name == "e2b":
        assert len(caches) == 4
        assert attn[4].producer is attn[2] and attn[5].producer is attn[3]
        assert layers[4].mlp.down_proj.weight.shape[1] == 2 * 96  # double-wide where shared
    else:
        assert len(caches) == 6
        assert [a.num_kv_heads for a in attn] == [2, 1] * 3
        assert all(layer.self_attn.qkv_proj.values == (i % 2 == 0) for i, layer in enumerate(layers))
    assert [layer.self_attn.head_dim for layer in layers] == [16, 32] * 3
    assert [a.sliding_window for a in caches[:2]] == [8, None]
    assert all(a.scale == 1.0 for a in caches)
    hf_scalar = case.hf.model.layers[1].layer_scalar
    torch.testing.assert_close(layers[1].layer_scalar, hf_scalar)
    assert not torch.equal(hf_scalar, torch.ones_like(hf_scalar))


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    """Chunks attend to cached context; KV-shared layers read their producer's cache and its
    step's rows."""
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS,
                          PROMPT_LENGTHS)


def test_prefix_cache_hit_matches(case: Case):
    """A second request sharing a 32-token prefix reads the first one's blocks (shared layers
    included, through their producers' caches)."""
    llm = LLM(case.folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=True,
              show_progress=False)
    first = prompt_ids(40, seed=8)
    second = first[:32] + prompt_ids(9, seed=9)
    llm.generate([first], greedy(4), use_tqdm=False)
    out = llm.generate([second], greedy(12), use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == hf_generate(case.hf, second, 12)


def test_bf16_stays_close(case: Case):
    """Within 0.15 of float32 logprobs, or within 3x transformers' own bf16 error where that
    is larger (these random models' unscaled scores make some draws touchy). On the 2-core
    AMX host, with transformers' bf16 at 0.140 (e2b) / 0.062 (moe): the engine with torch's
    SDPA for prefill 0.284 / 0.147, with the float32 FMA prefill kernel 0.237 / 0.157, with
    its AMX build 0.237 / 0.166 (mean errors 0.027 / 0.018 for both kernels)."""
    import copy

    ids = torch.tensor([prompt_ids(40, seed=6)])  # check_bf16_close's prompt
    with torch.no_grad():
        want = case.hf(ids).logits[0, :-1].log_softmax(-1)
        own = copy.deepcopy(case.hf).to(torch.bfloat16)(ids).logits[0, :-1].float().log_softmax(-1)
    hf_error = (own - want).gather(1, ids[0, 1:, None]).abs().max().item()
    check_bf16_close(case.folder, case.hf, NUM_KV_BLOCKS, tolerance=max(0.15, 3 * hf_error))


def test_proportional_rope_matters(tmp_path, tiny_tokenizer_dir):
    """Full layers with default rope over the whole head give other logits: the parity above
    checks the proportional table."""
    hf = make(tmp_path / "a", tiny_tokenizer_dir, "e2b")
    plain = make(tmp_path / "b", tiny_tokenizer_dir, "e2b", rope_parameters={**ROPE, FULL: ROPE[SLIDING]})
    plain.load_state_dict(hf.state_dict())
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - plain(ids).logits).abs().max() > 1e-2


def make_released(folder, tokenizer_dir=None, seed: int = 0):
    """Gemma4ForConditionalGeneration (the "e2b" language model with vision and audio towers),
    as the small releases are laid out; it brings its own tokenizer (with Gemma 4's named
    image tokens), so `tokenizer_dir` is not used."""
    from tests.conftest import TINY_CORPUS
    from tests.multimodal.gemma4_checkpoint import make_tiny_gemma4

    return make_tiny_gemma4(folder, TINY_CORPUS, seed, bidirectional=False, audio=True)


def test_released_layout_serves_text(tmp_path):
    """model_type "gemma4" (vision and audio towers beside the language model): its text
    generation equals transformers'; the end-of-turn id comes from the top level. Image and
    audio placeholder ids without their media read as the padding token, as transformers
    reads them. (Images: tests/multimodal/test_gemma4.py.)"""
    hf = make_released(tmp_path)
    llm = LLM(tmp_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    assert type(llm.engine.runner.model.language_model).__name__ == "Gemma4ForCausalLM"
    assert llm.engine.router.config.eos_token_id == hf.config.eos_token_id and len(hf.config.eos_token_id) == 2
    stray = prompt_ids(30, seed=5)
    stray[10], stray[20] = hf.config.image_token_id, hf.config.audio_token_id
    for prompt in (prompt_ids(30, seed=5), stray):
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_generate(hf, prompt, 12)


def test_assistant_only_config_is_refused(tmp_path, tiny_tokenizer_dir):
    """Every layer sharing KV is Gemma 4's drafting assistant (it reads its target's cache):
    a clear error, not a model that attends to nothing."""
    from tessera.models.gemma4.modeling import kv_producers
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(**{**BASE, "num_kv_shared_layers": 6})
    with pytest.raises(ValueError, match="assistant"):
        kv_producers(config)


def test_routed_by_model_type():
    assert router_classes()["gemma4_text"].__name__ == "Gemma4TextRouter"
    assert router_classes()["gemma4"].__name__ == "Gemma4VisionRouter"


def test_shared_layers_run_only_the_rows_read(tmp_path, tiny_tokenizer_dir):
    """The KV-shared layers write no cache: a prefill runs them for its last row alone (as a
    decode over the producers' caches), a partial chunk not at all, prompt logprobs for every
    row; the tokens and logprobs stay transformers'."""
    hf = make(tmp_path, tiny_tokenizer_dir, "e2b")
    llm = LLM(tmp_path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=16, max_num_seqs=4,
              show_progress=False)
    shared = llm.engine.runner.model.model.layers[4]
    seen = []
    run = shared.forward
    shared.forward = lambda rope, hidden, per_layer: seen.append(hidden.shape[0]) or run(rope, hidden, per_layer)
    prompt = prompt_ids(40, seed=2)
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_generate(hf, prompt, 3)
    assert seen == [1, 1, 1]  # chunks of 16, 16 (none), 8 (its last row), two decodes
    seen.clear()
    out = llm.generate([prompt[:12]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert seen == [12]
    with torch.no_grad():
        want = case_logprobs(hf, prompt[:12])
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, 12)]
    assert got == pytest.approx(want, abs=1e-4)


def case_logprobs(hf, ids: list[int]) -> list[float]:
    logp = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
