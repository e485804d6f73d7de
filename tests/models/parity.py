"""Shared pieces of the parity tests in tests/models: tessera against transformers on tiny
random checkpoints.

Helpers that know nothing of one architecture (random prompts, transformers' reference
tokens and logits, a recorder of the logits rows tessera's sampler saw, the float32
tolerance, a tiny checkpoint writer) and the checks that several test files run on their
own cases (`check_*`: plain functions, so pytest collects only the test files' own
`test_*` wrappers and their ids stay per file).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from tessera import LLM
from tessera.sampling.params import SamplingParams

# float32 on both sides: the math is the same, only the kernels and their summation order
# differ (paged vs dense attention, packed QKV / gate-up GEMMs, decode one token at a time
# vs one full-sequence forward). Measured max |diff| is ~3e-6 on logits of magnitude ~4;
# 1e-4 leaves ~30x headroom while any real error (a wrong rope frequency, a dropped bias, a
# mask off by one) moves logits by 1e-2 or more.
FP32_ATOL = 1e-4

VOCAB = 512
EOS = 2  # every tiny config's eos_token_id
GREEDY_NEW_TOKENS = 32

# A tiny Llama-family config (Mistral's argument names); make_tiny's default base.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
            tie_word_embeddings=False)


@dataclass
class Case:
    name: str
    folder: Path
    hf: torch.nn.Module  # transformers' model, float32, eval
    llm: LLM             # tessera, float32


def make_tiny(folder: Path, tokenizer_dir: Path, config_cls, model_cls, seed: int = 0,
              base: dict = BASE, tweak: Callable[[torch.nn.Module, torch.Generator], None] | None = None,
              **overrides) -> torch.nn.Module:
    """Saves a random transformers model (+ the tiny tokenizer) to `folder`; returns the
    float32 eval-mode model. Norm weights are randomised around 1 (a loader that skipped
    them, or a model that did not apply them, would fail); `tweak(model, generator)` then
    redraws what else a test needs drawn otherwise (routers, biases, sinks)."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    # of the shared defaults only the fields the config class has: an unknown one would become
    # an attribute a released config lacks (a Cohere 2 built on `rms_norm_eps` loaded here, not
    # from the hub); a test's own base says what its checkpoints carry
    if base is BASE:
        known = config_cls()
        base = {k: v for k, v in base.items() if _config_has(known, k)}
    model = model_cls(config_cls(**{**base, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        if tweak is not None:
            tweak(model, g)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


def _config_has(config, key: str) -> bool:
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:  # known, but refused as ambiguous (Gemma 4's per-layer head_dim)
        return True
    return True


def hf_generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate, EOS disabled (tessera's ignore_eos=True)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n
    return new


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of one forward over the whole sequence (row i predicts i+1)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_token_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of `tokens` following `prompt`, from one forward pass."""
    logp = torch.log_softmax(hf_logits(model, prompt + tokens)[len(prompt) - 1:-1], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def check_greedy_and_logprobs(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], n: int,
                              atol: float = 1e-4) -> list[list[int]]:
    """tessera's greedy tokens equal transformers' generate, and the log-probabilities
    tessera reports for them equal transformers' within `atol`; returns the tokens."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    tokens = []
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert got == hf_generate(hf, prompt, n)
        logprobs = [lp[t].logprob for t, lp in zip(got, out.outputs[0].logprobs)]
        assert logprobs == pytest.approx(hf_token_logprobs(hf, prompt, got), abs=atol)
        tokens.append(got)
    return tokens


def greedy(n: int = GREEDY_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def prompt_ids(length: int, seed: int) -> list[int]:
    """Random token ids (3.. avoids the special tokens), deterministic per (length, seed)."""
    g = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


class LogitRecorder:
    """Wraps the runner's forward (its first pass: model.compute_logits for sampled rows) and
    records, per sampled row, the request, the length of the prefix it predicts after, and
    the logits row the sampler saw."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch):
        self.rows: list[tuple[str, int, torch.Tensor]] = []
        self.steps: list[dict] = []
        runner = llm.engine.runner
        original = runner.forward

        def forward(inputs):
            passes = original(inputs)
            logits = next(passes)  # the sampled rows' pass (these tests want no prompt logprobs)
            assert logits.dtype == torch.float32
            assert logits.shape == (len(inputs.sampled_rows), VOCAB)
            for item, row in zip(inputs.sampled_rows, logits):
                # Called before the engine advances num_computed_tokens.
                prefix = item.seq.num_computed_tokens + item.num_new_tokens
                self.rows.append((item.seq.request_id, prefix, row.clone().cpu()))  # GPU rows too
            meta = inputs.attn
            self.steps.append(dict(num_decodes=meta.num_decodes, num_seqs=meta.num_seqs,
                                   query_lens=list(meta.query_lens_list)))
            yield logits
            yield from passes

        monkeypatch.setattr(runner, "forward", forward)

    def for_request(self, request_id: str) -> list[tuple[int, torch.Tensor]]:
        return [(prefix, row) for rid, prefix, row in self.rows if rid == request_id]


def assert_rows_match(rows: list[tuple[int, torch.Tensor]], reference: torch.Tensor,
                      atol: float, what: str) -> None:
    for prefix, row in rows:
        expected = reference[prefix - 1]
        diff = (row - expected).abs().max().item()
        assert diff <= atol, (f"{what}: logits after {prefix} tokens differ from transformers "
                              f"by {diff:.3g} > {atol}")


# --- checks the test files share -------------------------------------------------------------

def check_prefill_and_decode_logits(llm: LLM, hf: torch.nn.Module, name: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One request: the prefill's logits and those of 8 single-token decode steps equal
    transformers' (teacher-forced on tessera's tokens), and each sampled token is its row's
    argmax."""
    prompt = prompt_ids(27, seed=1)  # decodes cross the block boundary at 32
    rec = LogitRecorder(llm, monkeypatch)
    out = llm.generate([prompt], greedy(9), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 9
    rows = rec.for_request(out.request_id)
    assert [p for p, _ in rows] == list(range(27, 36))  # 1 prefill + 8 decodes
    assert [s["query_lens"] for s in rec.steps] == [[27]] + [[1]] * 8
    for (_, row), token in zip(rows, tokens):
        assert int(row.argmax()) == token
    assert_rows_match(rows, hf_logits(hf, prompt + tokens), FP32_ATOL, name)


def check_greedy_alone_and_batched(llm: LLM, hf: torch.nn.Module, prompt_lengths,
                                   new_tokens: int = GREEDY_NEW_TOKENS) -> None:
    """Greedy tokens equal transformers' generate, for each prompt alone, then all batched."""
    prompts = [prompt_ids(n, seed=3) for n in prompt_lengths]
    expected = [hf_generate(hf, p, new_tokens) for p in prompts]
    for prompt, want in zip(prompts, expected):
        out = llm.generate([prompt], greedy(new_tokens), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
        assert out.finish_reason == "length"
    batched = llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == expected


def check_chunked_prefill(folder: Path, llm: LLM, hf: torch.nn.Module, name: str,
                          monkeypatch: pytest.MonkeyPatch, num_kv_blocks: int, prompt_lengths,
                          new_tokens: int = GREEDY_NEW_TOKENS) -> None:
    """A second engine on `folder` with 16-token steps: the longer prompts go in chunks that
    attend to cached context; tokens equal `llm`'s unchunked ones and transformers', and
    every sampled logits row equals transformers'."""
    prompts = [prompt_ids(n, seed=4) for n in prompt_lengths]
    whole = [o.outputs[0].token_ids
             for o in llm.generate(prompts, greedy(new_tokens), use_tqdm=False)]
    chunked_llm = LLM(folder, dtype="float32", num_kv_blocks=num_kv_blocks,
                      max_num_batched_tokens=16, max_num_seqs=16, show_progress=False)
    rec = LogitRecorder(chunked_llm, monkeypatch)
    outs = chunked_llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
    assert max(sum(s["query_lens"]) for s in rec.steps) == 16
    assert [o.outputs[0].token_ids for o in outs] == whole
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_generate(hf, prompt, new_tokens)
        assert_rows_match(rec.for_request(out.request_id), hf_logits(hf, prompt + tokens),
                          FP32_ATOL, f"{name} chunked {len(prompt)}")


def check_bf16_close(folder: Path, hf: torch.nn.Module, num_kv_blocks: int, prompt_len: int = 40,
                     new_tokens: int = 6, tolerance: float = 0.15) -> LLM:
    """bf16 through the CPU kernels: the logprobs of a prompt and its continuation stay
    within bf16 noise (`tolerance`) of transformers' float32 ones. Returns the engine."""
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=num_kv_blocks, show_progress=False)
    prompt = prompt_ids(prompt_len, seed=6)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    want = hf_logits(hf, prompt + tokens).log_softmax(-1)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    got += [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)]
    expected = want[:-1].gather(1, torch.tensor(prompt[1:] + tokens)[:, None])[:, 0]
    assert (torch.tensor(got) - expected).abs().max() < tolerance
    return llm


def draw_hybrid_parameters(model: torch.nn.Module, g: torch.Generator) -> None:
    """Mamba-2's decays (A_log), time-step biases and skips (D) away from their neutral
    initial values (a model that ignored one would still match transformers otherwise);
    routers and their choice biases at scales that matter. A `make_tiny` tweak."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif ".router." in name or name.endswith(("mixer.gate.weight", "feed_forward.gate.weight")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # (sigmoid routers' choice biases)
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def check_second_turn_restores_state(folder: Path, hf: torch.nn.Module, num_kv_blocks: int) -> None:
    """A model with recurrent layers, prefix caching on (the default): a conversation's
    second turn starts from the snapshot of the first's state at its last block boundary
    (48 of its 66 tokens), and its greedy tokens are transformers'."""
    llm = LLM(folder, dtype="float32", num_kv_blocks=num_kv_blocks, show_progress=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first = prompt_ids(37, seed=21)
    second = first + llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids + prompt_ids(9, seed=22)
    assert llm.generate([second], params, use_tqdm=False)[0].outputs[0].token_ids == hf_generate(hf, second, 20)
    assert llm.engine.block_manager.prefix_hits == 48


def tiny_case(name: str, tmp_path_factory, tokenizer_dir: Path, make: Callable, num_kv_blocks: int = 64) -> Case:
    """A family's `case` fixture: `make(folder, tokenizer_dir, name)`'s checkpoint and a
    float32 engine on it."""
    folder = tmp_path_factory.mktemp(name)
    hf = make(folder, tokenizer_dir, name)
    return Case(name, folder, hf, LLM(folder, dtype="float32", num_kv_blocks=num_kv_blocks, show_progress=False))


class LogitParity:
    """The parity tests of a family's test file, over its `case` fixture (subclass as
    `TestParity`): prefill and decode logits, greedy alone and batched, chunked prefill."""

    num_kv_blocks = 64
    prompt_lengths = (5, 23, 47)

    def test_prefill_and_decode_logits_match(self, case: Case, monkeypatch):
        check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)

    def test_greedy_matches_hf_generate_alone_and_batched(self, case: Case):
        check_greedy_alone_and_batched(case.llm, case.hf, self.prompt_lengths)

    def test_chunked_prefill_matches(self, case: Case, monkeypatch):
        """16-token steps (for recurrent layers: each prompt's chunks continue its state)."""
        check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, self.num_kv_blocks,
                              self.prompt_lengths)


# --- models with recurrent layers: what every hybrid family's test file runs ------------------

def recurrent_case(name: str, tmp_path_factory, tokenizer_dir: Path, make: Callable, num_kv_blocks: int = 64) -> Case:
    """A hybrid family's `case` fixture: `make(name, folder, tokenizer_dir, seed)`'s checkpoint
    and an engine without prefix caching, which cuts prompts at a block boundary (the
    checks below assert how steps split)."""
    folder = tmp_path_factory.mktemp(name)
    hf = make(name, folder, tokenizer_dir, seed=len(name))
    llm = LLM(folder, dtype="float32", num_kv_blocks=num_kv_blocks, enable_prefix_caching=False, show_progress=False)
    return Case(name, folder, hf, llm)


class RecurrentParity(LogitParity):
    """The parity tests of a hybrid family's test file, over its `case` fixture (subclass
    as `TestParity`)."""

    prompt_lengths = (5, 23, 90)  # 90: two of the prefill kernels' 64-token blocks in one chunk


def check_beam_search(llm: LLM, hf: torch.nn.Module, width: int = 3, new_tokens: int = 8) -> None:
    """Beam search's hypotheses and scores are transformers' (its beams recomputed from
    scratch each step: use_cache=False, so no cache of its needs reordering)."""
    prompts = [prompt_ids(6, seed=31), prompt_ids(13, seed=32)]
    params = SamplingParams(use_beam_search=True, n=width, max_tokens=new_tokens)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        hf_out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=new_tokens, use_cache=False, eos_token_id=EOS, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        expected = []
        for seq in hf_out.sequences.tolist():
            generated = seq[len(prompt):]
            expected.append(generated[:generated.index(EOS) + 1] if EOS in generated else generated)
        assert [list(c.token_ids) for c in out.outputs] == expected
        scores = torch.tensor([c.cumulative_logprob / len(c.token_ids) for c in out.outputs])
        assert torch.allclose(scores, hf_out.sequences_scores.float(), atol=1e-4)


class RecurrentStateChecks(RecurrentParity):
    """... and with prefix caching on, a restored second turn; bf16 near float32."""

    def test_second_turn_restores_state(self, case: Case):
        check_second_turn_restores_state(case.folder, case.hf, self.num_kv_blocks)

    def test_beam_search_forks_the_state(self, case: Case):
        check_beam_search(case.llm, case.hf)

    def test_bf16_stays_close(self, case: Case):
        check_bf16_close(case.folder, case.hf, self.num_kv_blocks, prompt_len=80, new_tokens=8)
