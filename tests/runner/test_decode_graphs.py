"""Captured decode graphs (CPU) against the eager path: the same tokens and logprobs for
batches that shrink through the buckets, padded buckets, mixed prefill/decode steps (which
run eagerly) between replays, seeded sampling, int8 and int4; buckets whose pass is not kernels
alone run eagerly (all of them for a model without CPU kernels, only some for qwen3), and
graphs are dropped when the KV cache is replaced."""
from __future__ import annotations

import pytest

from tessera import LLM, SamplingParams
from tessera.ops.cpu.build import missing_cpu_flags, unavailable_reason
from tessera.ops.cpu.linear_int4 import kernel_unavailable as int4_unavailable
from tessera.ops.cpu.linear_int8 import _KERNEL as _INT8_KERNEL

# the AVX512 kernels, or their AVX2 builds (TESSERA_CPU_KERNEL_ISA=avx2 runs this file that way)
UNAVAILABLE = unavailable_reason("gemm_bf16.c") and unavailable_reason("gemm_bf16_avx2.c")
# why a quantized format's GEMM runs in torch here (int8: the AVX512 or the AVX2 build)
QUANT_UNAVAILABLE = {"int8": "; ".join(_INT8_KERNEL.check(None)) or None,
                     "int4": "; ".join(int4_unavailable()) or None}
# the AVX2 GEMM build (no AVX512, or TESSERA_CPU_KERNEL_ISA=avx2) takes weights of whole
# 16-row panels only; smaller projections run in torch there, and their steps eagerly
AVX2_GEMM = bool(missing_cpu_flags())
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
              pytest.mark.usefixtures("one_thread")]

PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, list(range(100, 117)), [3, 9] * 12]
# lengths that retire sequences one by one: 5 rows, then 4, 3, 2, 1
NEW_TOKENS = [6, 11, 17, 24, 30]


def run(llm: LLM, temperature: float = 0.0, count: int = len(PROMPTS)) -> list[tuple[list[int], list]]:
    params = [SamplingParams(max_new_tokens=n, temperature=temperature, seed=i, logprobs=3,
                             ignore_eos=True) for i, n in enumerate(NEW_TOKENS[-count:])]
    outs = llm.generate(PROMPTS[-count:], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replayed_decode_equals_eager(make_tiny_llama, quantization, temperature):
    if quantization and QUANT_UNAVAILABLE[quantization]:
        pytest.skip(f"{quantization} weights run in torch here: {QUANT_UNAVAILABLE[quantization]}")
    folder, _ = make_tiny_llama(seed=3)
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="bfloat16", quantization=quantization, num_kv_blocks=64,
                 block_size=8, enforce_eager=eager, show_progress=False) as llm:
            results[eager] = run(llm, temperature)
            graphs = llm.engine.runner.graphs
            if eager:
                assert graphs is None
            else:
                assert graphs.captured_sizes == [1, 2, 3, 4, 5] and graphs.eager_sizes == []
    assert results[False] == results[True]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_padded_rows_change_nothing(make_tiny_llama, quantization):
    """9 to 16 sequences share the 16-row graph: the padded rows write no KV and leave the
    real rows as an eager step of the same rows computes them (int8 and int4 too: their
    GEMMs switch paths by row count, never inside a bucket)."""
    if quantization and QUANT_UNAVAILABLE[quantization]:
        pytest.skip(f"{quantization} weights run in torch here: {QUANT_UNAVAILABLE[quantization]}")
    folder, _ = make_tiny_llama(seed=7)
    assert_padded_steps_equal_eager(folder, quantization)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_padded_rows_of_a_mixture_change_nothing(quantization, tiny_tokenizer_dir, tmp_path):
    """A mixture's padded rows run no experts (the step's live rows, read by the one-call
    layer); its real rows are what an eager step computes."""
    if quantization and QUANT_UNAVAILABLE[quantization]:
        pytest.skip(f"{quantization} weights run in torch here: {QUANT_UNAVAILABLE[quantization]}")
    make_tiny_mixture(tmp_path, tiny_tokenizer_dir)
    assert_padded_steps_equal_eager(tmp_path, quantization)


def assert_padded_steps_equal_eager(folder, quantization: str | None) -> None:
    """11 sequences (the 16-row graph) then fewer, with graphs and eagerly: the same."""
    prompts = [[5 + i, 6, 7 + 2 * i] * (1 + i % 4) for i in range(11)]
    params = [SamplingParams(max_new_tokens=4 + i, temperature=0.0, logprobs=2, ignore_eos=True)
              for i in range(11)]
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="bfloat16", quantization=quantization, num_kv_blocks=96, block_size=8,
                 enforce_eager=eager, show_progress=False) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            if not eager:
                assert 16 in llm.engine.runner.graphs.captured_sizes
    assert results[False] == results[True]


def test_chunked_prefill_steps_run_eagerly_between_replays(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=4)
    results = {}
    for eager in (True, False):
        # 16 tokens a step: prompts arrive in chunks while earlier ones decode
        with LLM(folder, dtype="bfloat16", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=8,
                 enforce_eager=eager, show_progress=False) as llm:
            results[eager] = run(llm)
            if not eager:
                assert llm.engine.runner.graphs.captured_sizes
    assert results[False] == results[True]


def test_graphs_turn_off_for_a_model_without_cpu_kernels(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=5)
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="float32", num_kv_blocks=64, block_size=8, enforce_eager=eager,
                 show_progress=False) as llm:
            results[eager] = run(llm)
            if not eager:
                graphs = llm.engine.runner.graphs
                assert graphs.captured_sizes == [] and graphs.eager_sizes == [1, 2, 3, 4, 5]
    assert results[False] == results[True]


@pytest.mark.parametrize("kind", ["qwen3", "gemma3_text"])
def test_head_norms_and_scaled_embeddings_replay_at_every_bucket(kind, tiny_tokenizer_dir, tmp_path):
    """Qwen3's and Gemma 3's per-head q/k norms read their heads in place from the QKV
    projection's rows (a reshape would copy from two rows on), Gemma's embedding scale is
    in the embedding kernel and its GELU MLP a kernel: every bucket is captured, and the
    replays equal the eager steps."""
    if kind == "qwen3":
        from tests.models.test_qwen_parity import make_tiny_qwen
        make_tiny_qwen(tmp_path, tiny_tokenizer_dir, "qwen3", seed=8, head_dim=16)
    else:
        from tests.models.test_gemma3_parity import make
        make(tmp_path, tiny_tokenizer_dir, "gemma3-tied")
    assert replayed_and_eager_buckets(tmp_path) == ([1, 2, 3], [])


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_mixtures_of_experts_replay_at_every_bucket(quantization, tiny_tokenizer_dir, tmp_path):
    """A mixture's routing and experts are one kernel call each (ops/cpu/moe_routing.py,
    ops/cpu/moe_experts.py), so its decode steps replay too, equal to the eager steps; the
    router picks varied experts (its weights scaled up), so the replays route differently
    from the captured pass."""
    if quantization and QUANT_UNAVAILABLE[quantization]:
        pytest.skip(f"{quantization} weights run in torch here: {QUANT_UNAVAILABLE[quantization]}")
    make_tiny_mixture(tmp_path, tiny_tokenizer_dir)
    assert replayed_and_eager_buckets(tmp_path, quantization) == ([1, 2, 3], [])


@pytest.mark.parametrize("kind", ["glm4_moe", "lfm2_moe", "minimax_m2"])
def test_scored_routers_replay_at_every_bucket(kind, tiny_tokenizer_dir, tmp_path):
    """GLM-4.5's router (DeepSeek V3's: a float32 router, sigmoid scores, a choice bias, the
    weights renormalised and scaled; its shared expert added by a kernel), MiniMax-M2's (its
    norms over whole q / k projections read in place) and LFM2-MoE's are one C call
    (moe_scored_routing), so their decode steps replay, equal to the eager ones."""
    if kind == "glm4_moe":
        from tests.models.test_glm4_moe import make_tiny_glm4_moe
        make_tiny_glm4_moe(tmp_path, tiny_tokenizer_dir, seed=2)
    elif kind == "minimax_m2":
        from tests.models.test_minimax_m2 import make_tiny_minimax_m2
        make_tiny_minimax_m2(tmp_path, tiny_tokenizer_dir, seed=2)
    else:
        from tests.models.test_lfm2 import make_tiny_lfm2
        # 16 experts: a router the packed kernels take on every build (4 rows run in torch on AVX2)
        make_tiny_lfm2("lfm2-moe", tmp_path, tiny_tokenizer_dir, seed=2, num_experts=16)
    assert replayed_and_eager_buckets(tmp_path) == ([1, 2, 3], [])


@pytest.mark.parametrize("kind", ["glm4-gqa-bias", "ernie4_5_moe"])
def test_interleaved_rotary_replays_at_every_bucket(kind, tiny_tokenizer_dir, tmp_path):
    """Rotary on neighbouring pairs (GLM-4's over half of each head, ERNIE 4.5's with its
    scored router) is the rotary kernel's too, so their decode steps replay."""
    if kind == "ernie4_5_moe":
        from tests.models.test_ernie4_5 import MOE, make_tiny_ernie
        make_tiny_ernie(tmp_path, tiny_tokenizer_dir, kind, seed=2, **MOE)
    else:
        from tests.models.families import make_family
        make_family(tmp_path, tiny_tokenizer_dir, kind, seed=2)
    assert replayed_and_eager_buckets(tmp_path) == ([1, 2, 3], [])


def test_gpt_oss_mxfp4_experts_replay_at_every_bucket(tiny_tokenizer_dir, tmp_path):
    """gpt-oss as its checkpoint keeps it: MXFP4 stacks, a biased router, biased experts
    and the clamped SwiGLU run in the one-call layer, the sinks in the attention kernels: its
    decode steps replay, equal to the eager ones."""
    from tessera.ops.cpu.moe_mxfp4 import _bf16_kernel_runs
    from tests.models.test_gpt_oss import make_mxfp4_checkpoint

    if not _bf16_kernel_runs():
        pytest.skip("the MXFP4 experts' bf16 kernel does not run here (AVX2 only)")
    make_mxfp4_checkpoint(tmp_path / "gpt-oss", tiny_tokenizer_dir)
    assert replayed_and_eager_buckets(tmp_path / "gpt-oss") == ([1, 2, 3], [])


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h",
                                  "nemotron_3", "granite_hybrid", "bamba", "falcon_h1"])
def test_recurrent_layers_replay_with_their_slots_as_an_input(kind, tiny_tokenizer_dir, tmp_path):
    """LFM2's gated short convolutions, Qwen3.5's / Qwen3-Next's Gated DeltaNets and
    Nemotron-H's, Granite 4.0-H's, Bamba's and Falcon-H1's Mamba-2 mixers keep a state per
    sequence: the graphs read the step's state slots from a buffer, and their gates, gated
    norms, partial rotary, sigmoid output gates, relu squared (Nemotron 3's gateless experts
    too), unrotated queries, scaled residual sums and muP multipliers are kernels, so every
    bucket replays, equal to the eager steps."""
    if kind == "lfm2":
        from tests.models.test_lfm2 import make_tiny_lfm2
        make_tiny_lfm2("lfm2-biased-conv", tmp_path, tiny_tokenizer_dir, seed=2)
    elif kind == "nemotron_h":
        from tests.models.test_nemotron_h import make_tiny_nemotron_h
        make_tiny_nemotron_h("nemotron-h-two-groups", tmp_path, tiny_tokenizer_dir, seed=2)
    elif kind == "nemotron_3":  # gateless relu-squared experts in the one-call layer, in a latent width
        from tests.models.test_nemotron_h import make_tiny_nemotron_h
        make_tiny_nemotron_h("nemotron-3-moe-latent", tmp_path, tiny_tokenizer_dir, seed=2, moe_latent_size=32)
    elif kind == "granite_hybrid":  # Granite 4.0-H: no rotary, experts and a shared MLP, multipliers
        from tests.models.test_granite_hybrid import make_tiny_granite_hybrid
        make_tiny_granite_hybrid("granite-4.0-h-moe-nope", tmp_path, tiny_tokenizer_dir, seed=2)
    elif kind == "bamba":
        from tests.models.test_bamba import make_tiny_bamba
        make_tiny_bamba("bamba-two-groups", tmp_path, tiny_tokenizer_dir, seed=2)
    elif kind == "falcon_h1":  # muP multipliers throughout (by number and by column), the gate without a norm
        from tests.models.test_falcon_h1 import make_tiny_falcon_h1
        make_tiny_falcon_h1("falcon-h1-gate-only", tmp_path, tiny_tokenizer_dir, seed=2)
    else:
        from tests.models.test_qwen3_next import make_tiny_qwen3_next
        make_tiny_qwen3_next(kind, tmp_path, tiny_tokenizer_dir, seed=2)
    captured, eager = replayed_and_eager_buckets(tmp_path)  # (the replays equal the eager steps)
    if AVX2_GEMM and kind != "lfm2":  # the tiny models' few-head projections run in torch there
        assert sorted(captured + eager) == [1, 2, 3]
    else:
        assert (captured, eager) == ([1, 2, 3], [])


def test_padded_rows_leave_the_recurrent_states_alone(tiny_tokenizer_dir, tmp_path):
    """A padded step's spare rows run on a slot no sequence holds: every sequence's state,
    and so its tokens, are what the eager steps give."""
    from tests.models.test_lfm2 import make_tiny_lfm2

    make_tiny_lfm2("lfm2-tied", tmp_path, tiny_tokenizer_dir, seed=4)
    assert_padded_steps_equal_eager(tmp_path, None)


def make_tiny_mixture(folder, tokenizer_dir) -> None:
    """A tiny Qwen3-MoE whose router picks varied experts (its weights scaled up), with 16
    experts: a router the packed kernels take on every build (8 rows run in torch on AVX2)."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.ops.test_moe_quantized import TINY_QWEN3_MOE

    torch.manual_seed(5)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, "num_experts": 16})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(25.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)


def test_granite_s_multipliers_replay_at_every_bucket(tiny_tokenizer_dir, tmp_path):
    """Granite 3.x: each sublayer's output times residual_multiplier is a kernel too."""
    from tests.models.families import make_family

    make_family(tmp_path, tiny_tokenizer_dir, "granite-gqa", seed=2)
    assert replayed_and_eager_buckets(tmp_path) == ([1, 2, 3], [])


@pytest.mark.parametrize("kind", ["olmo3-window8-yarn", "cohere2-window8-tied", "ministral3-yarn-temperature",
                                  "phi3-partial-longrope"])
def test_post_norms_and_position_tables_replay_at_every_bucket(kind, tiny_tokenizer_dir, tmp_path):
    """OLMo 3's residual adds after its post-norms are kernels, and Cohere 2's parallel
    block's sums and its bias-free LayerNorm (layer_norm.h); Ministral 3's query
    temperature is a table by position (a gather and a row scale); Phi-3's longrope keeps
    the long table's rows past its threshold in the short one, so a decode step gathers
    from one table without looking at the lengths. The sequences here decode past
    Ministral's original context (16) and Phi's threshold (32): every bucket replays,
    equal to the eager steps."""
    if kind.startswith("phi3"):
        from tests.models.test_phi3_parity import CASES, make_tiny_phi3
        make_tiny_phi3(tmp_path, tiny_tokenizer_dir, seed=2, **CASES["partial-longrope-tied"][0])
    else:
        from tests.models.families import make_family
        make_family(tmp_path, tiny_tokenizer_dir, kind, seed=2)
    assert replayed_and_eager_buckets(tmp_path) == ([1, 2, 3], [])


@pytest.mark.parametrize("case", ["e2b", "moe"])
def test_gemma4_replays_at_every_bucket(case, tiny_tokenizer_dir, tmp_path):
    """Gemma 4's residual sums with the layer scalar, its per-layer inputs (the gate a
    two-tensor GELU product) and its router (norm, scales and the per-expert scales in the
    routing call) are kernels: E2B's shape (per-layer inputs, KV-shared layers) and the
    26B A4B's (experts beside the MLP) replay at every bucket, equal to the eager steps."""
    from tests.models.test_gemma4 import make

    make(tmp_path, tiny_tokenizer_dir, case)
    captured, eager = replayed_and_eager_buckets(tmp_path)  # (the replays equal the eager steps)
    if AVX2_GEMM:  # the tiny model's narrow projections (8 rows) run in torch there
        assert sorted(captured + eager) == [1, 2, 3]
    else:
        assert (captured, eager) == ([1, 2, 3], [])


@pytest.mark.parametrize("kind", ["v3-yarn-qlora", "v2-lite-greedy", "mistral4"])
def test_latent_attention_replays_at_every_bucket(kind, tiny_tokenizer_dir, tmp_path):
    """Multi-head latent attention (DeepSeek V2 / V3, Mistral 4 with its query temperature):
    the absorbed per-head products and the latent / rotary concats are kernels, rotary reads
    the queries' rotary parts in place, so every bucket replays, equal to the eager steps."""
    if kind == "mistral4":
        from tests.models.test_mistral4 import make_tiny_mistral4
        make_tiny_mistral4(tmp_path, tiny_tokenizer_dir, seed=2)
    else:
        from tests.models.test_deepseek import CASES, make_tiny_deepseek
        family, overrides = CASES[kind]
        make_tiny_deepseek(tmp_path, tiny_tokenizer_dir, family, seed=2, **overrides)
    captured, eager = replayed_and_eager_buckets(tmp_path)  # (the replays equal the eager steps)
    if AVX2_GEMM:  # the tiny model's latent projection (40 rows) runs in torch there
        assert sorted(captured + eager) == [1, 2, 3]
    else:
        assert (captured, eager) == ([1, 2, 3], [])


def test_a_bucket_that_cannot_be_captured_leaves_the_others(tiny_tokenizer_dir, tmp_path, monkeypatch):
    """A pass that runs torch compute from two rows on (here Qwen3's head norms through a
    reshape, which copies a strided slice from two rows: a view at one) runs eagerly at
    those buckets only."""
    from tessera.models.qwen3.modeling import HeadNormForward
    from tests.models.test_qwen_parity import make_tiny_qwen

    monkeypatch.setattr(HeadNormForward, "_head_norm", lambda self, norm, x: norm(
        x.reshape(-1, self.head_dim)).reshape(x.shape[0], -1))
    make_tiny_qwen(tmp_path, tiny_tokenizer_dir, "qwen3", seed=8, head_dim=16)
    assert replayed_and_eager_buckets(tmp_path) == ([1], [2, 3])


def replayed_and_eager_buckets(folder, quantization: str | None = None) -> tuple[list[int], list[int]]:
    """Three prompts of the model in `folder`, eager and with graphs: the answers must be
    equal; returns (captured buckets, buckets run eagerly)."""
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="bfloat16", quantization=quantization, num_kv_blocks=64, block_size=8,
                 enforce_eager=eager, show_progress=False) as llm:
            results[eager] = run(llm, count=3)
            graphs = llm.engine.runner.graphs
            buckets = (graphs.captured_sizes, graphs.eager_sizes) if graphs is not None else None
    assert results[False] == results[True]
    return buckets


def test_replacing_the_kv_cache_drops_the_graphs(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=6)
    with LLM(folder, dtype="bfloat16", num_kv_blocks=64, block_size=8,
             enable_prefix_caching=False, show_progress=False) as llm:
        first = run(llm)
        runner = llm.engine.runner
        assert runner.graphs.captured_sizes
        runner.allocate_kv_cache(runner.num_blocks)  # new cache tensors
        assert runner.graphs.captured_sizes == []
        assert run(llm) == first


def test_lora_rows_replay_in_the_graphs(make_tiny_llama, tmp_path):
    """With LoRA on, every bucket's graph holds a lora_rows call per linear layer, reading
    each row's slot from a buffer: decode steps mixing two adapters and the base model
    replay (none runs eagerly) and equal the eager path; the adapters do change the
    output."""
    from tests.lora.peft_adapters import save_peft_adapter
    from tessera.lora import LoRARequest

    folder, hf = make_tiny_llama(seed=3)
    loras = [LoRARequest(f"a{i}", i + 1, str(save_peft_adapter(hf, tmp_path / f"a{i}", seed=i, std=0.5,
                                                                  target_modules=targets) and tmp_path / f"a{i}"))
             for i, targets in enumerate([["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "up_proj"]])]
    per_prompt = [loras[0], None, loras[1], loras[0], None]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=3, ignore_eos=True) for n in NEW_TOKENS]
    results, base = {}, None
    for eager in (True, False):
        with LLM(folder, dtype="bfloat16", num_kv_blocks=64, block_size=8, enforce_eager=eager,
                 show_progress=False, enable_lora=True, max_loras=2) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=per_prompt)
            results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            if not eager:
                graphs = llm.engine.runner.graphs
                assert graphs.captured_sizes == [1, 2, 3, 4, 5] and graphs.eager_sizes == []
                symbols = [k.symbol for k, _ in graphs._graphs[5].graph.calls]
                assert symbols.count("tessera_lora_rows_bf16") == 4 * 2  # 4 linear layers x 2 layers
                base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert results[False] == results[True]
    adapted = [i for i, lora in enumerate(per_prompt) if lora is not None]
    assert all(results[False][i][0] != base[i] for i in adapted)
    assert all(results[False][i][0] == base[i] for i in range(len(PROMPTS)) if i not in adapted)
