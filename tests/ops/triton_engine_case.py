"""The whole engine with every Triton builder in place of the torch ops, on CPU tensors
through Triton's interpreter (run by test_triton_kernels.py in a subprocess with
TRITON_INTERPRET=1): what a CUDA run would execute, kernel for kernel, as the engine calls
it (its metadata, its strides and views, mixed prefill/decode steps, prefix-cache hits,
chunked prefill, speculative decoding's verifying rows), against transformers' greedy
tokens and logits in float32.

    TRITON_INTERPRET=1 python -m tests.ops.triton_engine_case FOLDER [FOLDER ...]

Each FOLDER holds a tiny checkpoint (and its tokenizer) saved by the test."""
from __future__ import annotations

import sys

import torch

from tessera import LLM, SamplingParams
from tessera.ops import registry
from tessera.ops.triton import activation, kv_write, paged_decode, paged_prefill, rms_norm, rotary  # noqa: F401
from tessera.ops.triton.interpreted import expose_triton_builders_on_cpu

from tests.models.parity import FP32_ATOL, hf_generate, hf_logits

NEW_TOKENS = 6


def replay_like_a_cuda_graph(llm: LLM) -> list[int]:
    """From now on, each decode-only step also runs as a captured CUDA graph replays it
    (runner/cuda_graphs.py without the capture): inputs copied into the static buffers,
    padded up to the bucket (slot -1, one key of block 0), host-side lengths at
    max_model_len, so the decode grid covers partitions past every sequence's end. Its rows
    must equal the eager step's. Returns the (rows, bucket) of each step it checked, growing."""
    from tessera.ops.attention import attention_context
    from tessera.runner.cuda_graphs import cuda_buckets
    from tessera.runner.graph_inputs import GraphLimits, StaticDecodeInputs

    runner = llm.engine.runner
    limits = GraphLimits(llm.engine.runner.graph_limits.max_rows, llm.engine.max_model_len)
    static = StaticDecodeInputs(cuda_buckets(limits.max_rows), limits, runner.block_size, runner.device)
    eager_run, checked = runner._run_model, []

    def run_model(inputs):
        eager = eager_run(inputs)
        bucket = static.bucket_for(inputs)
        if bucket is not None:
            rows = inputs.input_ids.shape[0]
            static.fill(inputs, bucket)
            with attention_context(static.metadata(bucket, [limits.max_model_len] * bucket)):
                replayed = runner.model(static.ids[:bucket], static.positions[:bucket])
            torch.testing.assert_close(replayed[:rows], eager, atol=1e-5, rtol=1e-5)
            checked.append((rows, bucket))
        return eager

    runner._run_model = run_model
    return checked


def check(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    shared = torch.randint(3, vocab, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 14)]
    prompts += [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 40)]
    # 16 tokens a step: long prompts arrive in chunks while others decode; block 4 with
    # prefix caching: the second shared prompt reuses the first one's blocks
    with LLM(folder, dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=16,
             max_num_seqs=4, enforce_eager=True, show_progress=False) as llm:
        used = {c.builder.name for c in registry.selections() if c.spec.device == "cpu"}
        assert {"interpreted_triton_paged_decode", "interpreted_triton_paged_prefill",
                "interpreted_triton_rotary_kv_write", "interpreted_triton_rms_norm"} <= used, used
        replayed = replay_like_a_cuda_graph(llm)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                                prompt_logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.block_manager.prefix_hits == 0  # prompt logprobs: nothing skipped
        hits = llm.generate([prompts[1]], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                          ignore_eos=True), use_tqdm=False)[0]
        assert llm.engine.block_manager.prefix_hits > 0
        three = llm.generate(prompts[:3], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)  # decode steps of 3 rows: the 4-row bucket, padded
        assert [o.outputs[0].token_ids for o in three] == [o.outputs[0].token_ids[:3] for o in outs[:3]]
        assert any(rows < bucket for rows, bucket in replayed), replayed  # padded rows among them
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_generate(hf, prompt, NEW_TOKENS), (folder, len(prompt))
        logits = hf_logits(hf, prompt + tokens).log_softmax(-1)
        got = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)])
        want = logits[len(prompt) - 1:-1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
        got_prompt = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
        want_prompt = logits[:len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(got_prompt, want_prompt, atol=FP32_ATOL, rtol=0)
    assert hits.outputs[0].token_ids == outs[1].outputs[0].token_ids
    check_speculation(folder, hf, [p + p for p in prompts[2:4]])


def check_speculation(folder: str, hf, prompts: list[list[int]]) -> None:
    """Speculative decoding: drafts (here from the repeated prompts) verified as decode
    rows sharing a block table, through the Triton decode kernel, eagerly and as a CUDA
    graph replays them; greedy tokens equal transformers' whatever is accepted."""
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": None}
    with LLM(folder, dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=16,
             max_num_seqs=2, enforce_eager=True, speculative_config=spec, show_progress=False) as llm:
        replayed = replay_like_a_cuda_graph(llm)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        assert llm.engine.stats().spec_draft_tokens > 0
        assert any(rows > 2 for rows, _ in replayed), replayed  # verifying steps: more rows than sequences
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_generate(hf, prompt, 8), (folder, len(prompt))


if __name__ == "__main__":
    exposed = expose_triton_builders_on_cpu()
    assert len(exposed) >= 7, exposed
    for folder in sys.argv[1:]:
        check(folder)
    print("engine through triton OK")
