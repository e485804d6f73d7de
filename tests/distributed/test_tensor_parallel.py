"""Tensor parallelism on CPU over gloo: two ranks (the engine's own process and one it
starts) give transformers' greedy tokens for tiny checkpoints of every native type --
uneven head and vocabulary splits, fewer KV heads than ranks (replicated), MHA with biases
and tied embeddings, MoE experts -- and the default model's TP=1 tokens. A killed rank
fails the engine within seconds; each rank reads only its slices of a safetensors file."""
from __future__ import annotations

import functools

import time
from pathlib import Path

import pytest
import torch

from tessera import LLM
from tessera.config import ConfigError
from tessera.distributed.launcher import RankFailedError
from tessera.distributed.parallel import Span, TensorParallelError, split_heads
from tessera.models.registry import router_classes
from tessera.sampling.params import SamplingParams

from tests.models.parity import hf_generate, make_tiny, prompt_ids
from tests.models.test_bamba import CASES as BAMBA_CASES
from tests.models.test_bamba import make_tiny_bamba
from tests.models.test_deepseek import CASES as CASES_DEEPSEEK
from tests.models.test_deepseek import make_tiny_deepseek
from tests.models.test_falcon_h1 import CASES as FALCON_H1_CASES
from tests.models.test_falcon_h1 import make_tiny_falcon_h1
from tests.models.test_gpt_oss import make_mxfp4_checkpoint, make_tiny_gpt_oss
from tests.models.test_granite_hybrid import CASES as GRANITE_HYBRID_CASES
from tests.models.test_granite_hybrid import make_tiny_granite_hybrid
from tests.models.test_lfm2 import CASES as LFM2_CASES
from tests.models.test_lfm2 import make_tiny_lfm2
from tests.models.test_moe_parity import make_tiny_moe
from tests.models.test_nemotron_h import CASES as NEMOTRON_H_CASES
from tests.models.test_nemotron_h import make_tiny_nemotron_h
from tests.models.test_phi3_parity import make_tiny_phi3
from tests.models.test_qwen3_next import CASES as QWEN3_NEXT_CASES
from tests.models.test_qwen3_next import make_tiny_qwen3_next
from tests.models.test_qwen_parity import make_tiny_qwen

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 23, 47)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)]


def check_tp2_matches_hf(folder: Path, hf: torch.nn.Module, prompt_logprobs: bool = False) -> LLM:
    """TP=2 greedy tokens, batched, equal transformers' (each prompt alone). With
    `prompt_logprobs`, also a 300-token prompt's logprobs: the LM head takes its rows in
    three passes, each an all-gather every rank must join."""
    prompts = [prompt_ids(n, seed=3) for n in PROMPT_LENGTHS]
    expected = [hf_generate(hf, p, NEW_TOKENS) for p in prompts]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False,
             tensor_parallel_size=2) as llm:
        assert llm.engine.runner.model is not None and llm.engine.tp_group.world_size == 2
        assert generate(llm, prompts) == expected
        if prompt_logprobs:
            long = prompt_ids(300, seed=4)
            out = llm.generate([long], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0),
                               use_tqdm=False)[0]
            with torch.no_grad():
                want = hf(torch.tensor([long])).logits[0, :-1].float().log_softmax(-1)
            got = [out.prompt_logprobs[p][long[p]].logprob for p in range(1, 300)]
            torch.testing.assert_close(torch.tensor(got), want.gather(1, torch.tensor(long[1:])[:, None])[:, 0],
                                       atol=1e-4, rtol=0)
    return llm


# --- how heads are cut ---------------------------------------------------------------------

@pytest.mark.parametrize("heads, kv, size, want", [
    (9, 3, 2, [(Span(0, 3), Span(0, 1)), (Span(3, 6), Span(1, 2))]),      # SmolLM2: whole groups, uneven
    (4, 1, 2, [(Span(0, 2), Span(0, 1)), (Span(2, 2), Span(0, 1))]),      # one KV head, replicated
    (8, 2, 4, [(Span(0, 2), Span(0, 1)), (Span(2, 2), Span(0, 1)),
               (Span(4, 2), Span(1, 1)), (Span(6, 2), Span(1, 1))]),
    (4, 4, 2, [(Span(0, 2), Span(0, 2)), (Span(2, 2), Span(2, 2))]),      # MHA
])
def test_heads_split_into_whole_groups_or_replicated_kv(heads, kv, size, want):
    got = [split_heads(heads, kv, r, size) for r in range(size)]
    assert [(s.q, s.kv) for s in got] == want
    assert sum(s.q.size for s in got) == heads  # every query head computed exactly once


@pytest.mark.parametrize("heads, kv, size", [(6, 2, 3), (2, 1, 4)])
def test_impossible_splits_are_refused(heads, kv, size):
    with pytest.raises(TensorParallelError):
        split_heads(heads, kv, 0, size)


# --- each rank reads only its slices -----------------------------------------------------------

def test_rank_loads_only_its_slices_without_reading_whole_tensors(make_tiny_llama, monkeypatch):
    from tessera.models.registry import get_router
    from tessera.config import ModelConfig
    from tessera.ops.registry import OpTarget
    from tessera.weights import lazy

    folder, hf = make_tiny_llama(vocab_size=511, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=130)
    whole_reads: list[tuple] = []
    original = lazy.LazyTensor.load
    monkeypatch.setattr(lazy.LazyTensor, "load",
                        lambda self: whole_reads.append(tuple(self.shape)) or original(self))
    router = get_router(ModelConfig(model=str(folder)))
    model = router.build_model(OpTarget("cpu", torch.float32, tp_size=2, tp_rank=1)).eval()
    router.load_weights(model)
    # only 1-D norm weights are read whole; every matrix is read as this rank's slice
    assert whole_reads and all(len(shape) == 1 for shape in whole_reads)
    ours, theirs = model.model.layers[0], hf.model.layers[0]
    # rank 1 of 2 with 4 heads / 2 KV heads (head_dim 16): query heads 2-3, KV head 1
    q, k, v = ours.self_attn.qkv_proj.weight.split([32, 16, 16])
    torch.testing.assert_close(q, theirs.self_attn.q_proj.weight[32:64])
    torch.testing.assert_close(k, theirs.self_attn.k_proj.weight[16:32])
    torch.testing.assert_close(v, theirs.self_attn.v_proj.weight[16:32])
    torch.testing.assert_close(ours.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight[:, 32:64])
    torch.testing.assert_close(ours.mlp.down_proj.weight, theirs.mlp.down_proj.weight[:, 65:130])
    # vocabulary rows 256..510 and one zero row of padding
    emb = model.model.embed_tokens.weight
    torch.testing.assert_close(emb[:255], hf.model.embed_tokens.weight[256:])
    assert emb.shape[0] == 256 and not emb[255].any()


# --- parity with transformers at TP=2 ----------------------------------------------------------

LLAMA_CASES = {
    # 6 query / 3 KV heads: rank 0 computes one KV group, rank 1 two; odd vocab and MLP widths
    "uneven-gqa": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                       vocab_size=511, intermediate_size=130),
    "one-kv-head-replicated": dict(num_attention_heads=4, num_key_value_heads=1),
    "mha-bias-tied": dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                          mlp_bias=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(LLAMA_CASES))
def test_llama_tp2_matches_transformers(name, make_tiny_llama):
    folder, hf = make_tiny_llama(seed=len(name), initializer_range=0.1, **LLAMA_CASES[name])
    check_tp2_matches_hf(folder, hf, prompt_logprobs=name == "uneven-gqa")


def _zoo_checkpoint(kind: str, folder: Path, tokenizer_dir: Path) -> torch.nn.Module:
    if kind in ("qwen2", "qwen3"):
        return make_tiny_qwen(folder, tokenizer_dir, kind, seed=5)
    if kind == "mixtral":
        return make_tiny_moe(folder, tokenizer_dir, "mixtral", seed=5, num_local_experts=4,
                             intermediate_size=96)
    if kind == "qwen3_moe":
        return make_tiny_moe(folder, tokenizer_dir, "qwen3_moe", seed=5, num_experts=4,
                             moe_intermediate_size=48, num_experts_per_tok=2, norm_topk_prob=True)
    if kind == "phi3":
        return make_tiny_phi3(folder, tokenizer_dir, seed=5)
    if kind in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):  # MLA's heads split, its latent KV head replicated
        overrides = CASES_DEEPSEEK[{"deepseek_v3": "v3-yarn-qlora", "deepseek_v2": "v2-group-limited",
                                    "glm4_moe_lite": "glm4-moe-lite"}[kind]][1]
        return make_tiny_deepseek(folder, tokenizer_dir, kind, seed=5, **overrides)
    if kind == "glm4_moe":  # GQA heads and the partial rotary split by head; DeepSeek's experts split
        from tests.models.test_glm4_moe import CASES as GLM4_MOE_CASES
        from tests.models.test_glm4_moe import make_tiny_glm4_moe
        return make_tiny_glm4_moe(folder, tokenizer_dir, seed=5, **GLM4_MOE_CASES["qk-norm-groups"])
    if kind in ("ernie4_5", "ernie4_5_moe"):  # interleaved rotary per head; biases; experts split
        from tests.models.test_ernie4_5 import CASES as ERNIE_CASES
        from tests.models.test_ernie4_5 import make_tiny_ernie
        return make_tiny_ernie(folder, tokenizer_dir, kind, seed=5,
                               **ERNIE_CASES["dense-bias" if kind == "ernie4_5" else "moe"][1])
    if kind == "minimax_m2":  # whole-projection norms summed over the ranks; experts split
        from tests.models.test_minimax_m2 import make_tiny_minimax_m2
        return make_tiny_minimax_m2(folder, tokenizer_dir, seed=5)
    if kind == "gpt_oss":  # sinks split by head, expert biases (the down one added once)
        return make_tiny_gpt_oss(folder, tokenizer_dir, seed=5, intermediate_size=96)
    if kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        return make_tiny(folder, tokenizer_dir, MistralConfig, MistralForCausalLM, seed=5, sliding_window=8)
    if kind == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        from tests.models.test_gemma2_parity import BASE as GEMMA2_BASE
        return make_tiny(folder, tokenizer_dir, Gemma2Config, Gemma2ForCausalLM, seed=5,
                         base=GEMMA2_BASE, attn_implementation="eager")
    if kind == "gemma3_text":
        from tests.models.test_gemma3_parity import make as make_gemma3
        return make_gemma3(folder, tokenizer_dir, "gemma3-tied")
    if kind in FALCON_H1_CASES:  # both mixers split in every layer; one group (held whole) or two
        return make_tiny_falcon_h1(kind, folder, tokenizer_dir, seed=5)
    if kind in LFM2_CASES:  # the short convolution's channels split
        return make_tiny_lfm2(kind, folder, tokenizer_dir, seed=5)
    if kind in NEMOTRON_H_CASES:  # Mamba-2 heads, MLP and attention split
        return make_tiny_nemotron_h(kind, folder, tokenizer_dir, seed=5)
    if kind in GRANITE_HYBRID_CASES:  # Mamba-2's heads split; two groups split, one group held whole
        return make_tiny_granite_hybrid(kind, folder, tokenizer_dir, seed=5)
    if kind in BAMBA_CASES:
        return make_tiny_bamba(kind, folder, tokenizer_dir, seed=5)
    if kind == "mistral4":  # DeepSeek's split, Mistral's router replicated, the temperature per rank
        from tests.models.test_mistral4 import CASES as MISTRAL4_CASES
        from tests.models.test_mistral4 import make_tiny_mistral4
        return make_tiny_mistral4(folder, tokenizer_dir, seed=5, **MISTRAL4_CASES["yarn-temperature-qlora"])
    if kind in QWEN3_NEXT_CASES:  # linear attention: each rank one key head and its two value heads
        return make_tiny_qwen3_next(kind, folder, tokenizer_dir, seed=5)
    if kind in GEMMA4_CASES:  # PLE and KV sharing; experts, and full layers' one KV head replicated
        from tests.models import test_gemma4
        if kind == "gemma4":  # the released layout: vision and audio towers skipped
            return test_gemma4.make_released(folder, tokenizer_dir, seed=5)
        return test_gemma4.make(folder, tokenizer_dir, GEMMA4_CASES[kind])
    if kind in FAMILY_CASES:  # (olmo3: one KV head, replicated over the ranks)
        from tests.models.families import make_family
        return make_family(folder, tokenizer_dir, FAMILY_CASES[kind], seed=5,
                           **({"num_key_value_heads": 1} if kind == "olmo3" else {}))
    raise AssertionError(kind)


# the families of tests/models/families.py, by the case each is checked with here
FAMILY_CASES = {"smollm3": "smollm3-window8", "olmo2": "olmo2-gqa", "olmo3": "olmo3-window8-yarn",
                "ministral3": "ministral3-yarn-temperature", "granite": "granite-tied-bias", "glm4": "glm4-gqa-bias",
                "cohere2": "cohere2-window8-tied"}
GEMMA4_CASES = {"gemma4-e2b": "e2b", "gemma4-moe": "moe", "gemma4": None}
ZOO = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "gpt_oss",
       "deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe", "glm4_moe_lite", "minimax_m2", "ernie4_5", "ernie4_5_moe",
       *FAMILY_CASES, *QWEN3_NEXT_CASES,
       *GRANITE_HYBRID_CASES, *BAMBA_CASES, *NEMOTRON_H_CASES, *LFM2_CASES, *FALCON_H1_CASES, *GEMMA4_CASES)


@pytest.mark.parametrize("kind", ZOO)
def test_model_zoo_tp2_matches_transformers(kind, tmp_path, tiny_tokenizer_dir):
    hf = _zoo_checkpoint(kind, tmp_path, tiny_tokenizer_dir)
    assert hf.config.model_type == ("granitemoehybrid" if kind in GRANITE_HYBRID_CASES else
                                    "bamba" if kind in BAMBA_CASES else
                                    "nemotron_h" if kind in NEMOTRON_H_CASES else
                                    "lfm2_moe" if kind == "lfm2-moe" else "lfm2" if kind in LFM2_CASES else
                                    "falcon_h1" if kind in FALCON_H1_CASES else
                                    "gemma4_text" if kind in ("gemma4-e2b", "gemma4-moe") else kind)
    check_tp2_matches_hf(tmp_path, hf)


def test_gpt_oss_mxfp4_stacks_tp2_match_transformers(tmp_path, tiny_tokenizer_dir):
    """gpt-oss's MXFP4 experts stay packed on each rank, split in whole blocks (each rank
    reads its rows of w13 and its block of w2's input features)."""
    hf = make_mxfp4_checkpoint(tmp_path / "mxfp4", tiny_tokenizer_dir, seed=5)
    check_tp2_matches_hf(tmp_path / "mxfp4", hf)


@pytest.mark.parametrize("kind", ["llava", "llava_next", "idefics3", "smolvlm", "mistral3", "qwen2_5_vl", "qwen3_vl",
                                  "qwen3_vl_moe",
                                  "gemma3", "qwen3_5", "qwen3_5_moe", "gemma4"])
def test_images_tp2_equal_tp1(kind, tmp_path):
    """Image features (and M-RoPE's 3-D positions) reach every rank: the same greedy tokens
    as one rank for prompts with images, text alone, and 8-token chunks that split images."""
    from tests.conftest import TINY_CORPUS
    from tests.multimodal import checkpoints, gemma4_checkpoint, smolvlm_checkpoint

    make = {"llava": checkpoints.make_tiny_llava, "llava_next": checkpoints.make_tiny_llava_next,
            "idefics3": checkpoints.make_tiny_idefics3, "smolvlm": smolvlm_checkpoint.make_tiny_smolvlm,
            "mistral3": checkpoints.make_tiny_mistral3,
            "qwen2_5_vl": checkpoints.make_tiny_qwen2_vl, "qwen3_vl": checkpoints.make_tiny_qwen3_vl,
            "qwen3_vl_moe": functools.partial(checkpoints.make_tiny_qwen3_vl, moe=True),
            "gemma3": checkpoints.make_tiny_gemma3, "qwen3_5": checkpoints.make_tiny_qwen3_5_vl,
            "qwen3_5_moe": functools.partial(checkpoints.make_tiny_qwen3_5_vl, moe=True),
            "gemma4": gemma4_checkpoint.make_tiny_gemma4}[kind]
    make(tmp_path, TINY_CORPUS, seed=3)
    placeholder = {"qwen2_5_vl": checkpoints.QWEN_IMAGE, "qwen3_vl": checkpoints.QWEN_IMAGE,
                   "qwen3_5": checkpoints.QWEN_IMAGE, "qwen3_5_moe": checkpoints.QWEN_IMAGE,
                   "qwen3_vl_moe": checkpoints.QWEN_IMAGE, "mistral3": "[IMG]",
                   "gemma3": checkpoints.GEMMA3_IMAGE, "gemma4": gemma4_checkpoint.GEMMA4_IMAGE}.get(kind, "<image>")
    random_image = checkpoints.random_image
    prompts = [{"prompt": f"The quick {placeholder} brown fox {placeholder} jumps",
                "multi_modal_data": {"image": [random_image(1, size=(70, 100)), random_image(2)]}},
               "Paged attention stores", {"prompt": f"A {placeholder} of", "multi_modal_data": {"image": random_image(3)}}]
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8, show_progress=False)
    with LLM(tmp_path, **kwargs) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy(), use_tqdm=False)]
    with LLM(tmp_path, tensor_parallel_size=2, **kwargs) as two:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy(), use_tqdm=False)] == expected
        assert two.engine.model.vision.materialized  # the driver's; the other rank's is never built


def test_every_native_type_claims_tensor_parallel():
    hybrids = (set(GRANITE_HYBRID_CASES) | set(NEMOTRON_H_CASES) | set(LFM2_CASES) | set(FALCON_H1_CASES)
               | set(BAMBA_CASES))
    cases = hybrids | set(GEMMA4_CASES)
    tested = {"llama", *(set(ZOO) - cases), "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "falcon_h1", "bamba",
              "gemma4_text", "gemma4", "llava", "llava_next", "idefics3", "smolvlm", "mistral3", "qwen2_vl", "qwen2_5_vl",
              "qwen3_vl",
              "qwen3_vl_moe", "gemma3", "qwen3_5", "qwen3_5_moe"}
    assert {t for t, r in router_classes().items() if r.features()["supports_tensor_parallel"]} == tested


def test_default_model_tp2_equals_tp1(default_gguf):
    """SmolLM2-135M (9 query / 3 KV heads, 49152-token vocabulary, Q4_1 GGUF dequantized
    and sliced per rank): the same greedy tokens as one rank."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Paged attention is"]
    one = LLM(dtype="float32", num_kv_blocks=64, show_progress=False)
    token_prompts = [one.tokenizer(p).input_ids for p in prompts]
    expected = generate(one, token_prompts)
    with LLM(dtype="float32", num_kv_blocks=64, show_progress=False, tensor_parallel_size=2) as two:
        assert generate(two, token_prompts) == expected


def test_fp8_kv_cache_tp2_equals_tp1(make_tiny_llama):
    """Every rank builds its layers for, and allocates, the 8-bit cache the driver sized."""
    folder, _ = make_tiny_llama(seed=9, initializer_range=0.1)
    prompts = [prompt_ids(n, seed=5) for n in PROMPT_LENGTHS]
    with LLM(folder, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64, show_progress=False) as one:
        expected = generate(one, prompts)
    with LLM(folder, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64, show_progress=False,
             tensor_parallel_size=2) as two:
        assert two.engine.runner.kv_cache_dtype == torch.float8_e4m3fn
        assert generate(two, prompts) == expected


# --- failures ----------------------------------------------------------------------------------

def test_killed_rank_fails_the_engine_within_seconds(make_tiny_llama):
    folder, _ = make_tiny_llama(max_position_embeddings=4096)
    with LLM(folder, dtype="float32", num_kv_blocks=300, show_progress=False,
             tensor_parallel_size=2) as llm:
        assert generate(llm, [[5] * 10], 4)  # healthy first
        llm.engine.tp_group.processes[0].kill()
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1"):
            generate(llm, [[5] * 10], 4000)
        assert time.monotonic() - started < 10
        with pytest.raises(RankFailedError):  # and stays failed
            generate(llm, [[7] * 3], 2)


def test_fallback_models_refuse_tensor_parallel(tmp_path, tiny_tokenizer_dir):
    from tests.models.test_transformers_fallback import _olmo

    config_cls, model_cls, overrides = _olmo()
    make_tiny(tmp_path, tiny_tokenizer_dir, config_cls, model_cls, **overrides)
    with pytest.raises(ConfigError, match="does not support tensor parallelism"):
        LLM(tmp_path, dtype="float32", num_kv_blocks=8, show_progress=False, tensor_parallel_size=2)


def test_unsplittable_model_is_a_clear_error(make_tiny_llama):
    folder, _ = make_tiny_llama(num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(TensorParallelError, match="cannot be split over 4 ranks"):
        LLM(folder, dtype="float32", num_kv_blocks=8, show_progress=False, tensor_parallel_size=4)


# --- across machines: ranks launched from outside ----------------------------------------------

def test_two_launched_ranks_as_two_nodes_match_one_rank(make_tiny_llama, tmp_path):
    """Two `tessera generate` processes with torchrun's variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) meet over loopback as two nodes would: rank 0 prints the
    text, rank 1 serves its shard and exits when rank 0 is done."""
    import os
    import subprocess
    import sys

    from tessera.distributed.launcher import free_port

    folder, _ = make_tiny_llama(seed=3, num_attention_heads=4, num_key_value_heads=2)
    prompt = "The quick brown fox"
    args = [sys.executable, "-m", "tessera.cli", "generate", prompt, "--model", str(folder),
            "--dtype", "float32", "--num-kv-blocks", "64", "--max-new-tokens", "24", "--ignore-eos",
            "--tensor-parallel-size", "2"]
    port = str(free_port("127.0.0.1"))
    procs = []
    for rank in (1, 0):  # the order of arrival does not matter
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "TESSERA_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    rank1_stdout, rank0_stdout = outs[0][0], outs[1][0]
    assert rank1_stdout == ""  # only the driver answers
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False) as one:
        want = one.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].text
    assert rank0_stdout.strip() == want.strip()


def test_a_failed_sampling_step_leaves_the_ranks_in_step(make_tiny_llama, monkeypatch):
    """Sampling runs on rank 0 between the LM head's passes, each an all-gather the other
    rank joins: when it raises in a step with prompt-logprob passes still to come, rank 0
    still runs them, so the next requests are served as if nothing happened."""
    folder, hf = make_tiny_llama(seed=2, initializer_range=0.1)
    prompts = [prompt_ids(n, seed=3) for n in PROMPT_LENGTHS]
    with LLM(folder, dtype="float32", num_kv_blocks=64, show_progress=False, tensor_parallel_size=2) as llm:
        sampler = llm.engine.runner.sampler

        def failing(logits, batch):
            raise ValueError("injected sampling failure")

        monkeypatch.setattr(sampler, "sample", failing)
        with pytest.raises(ValueError, match="injected"):
            llm.generate([prompt_ids(300, seed=4)], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
        monkeypatch.undo()
        assert generate(llm, prompts, 8) == [hf_generate(hf, p, 8) for p in prompts]
