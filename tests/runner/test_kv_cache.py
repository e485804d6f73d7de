"""The KV cache is allocated uninitialised and zeroed block by block on first use."""
from __future__ import annotations

import torch

from tessera import LLM, SamplingParams


def _poison(llm: LLM) -> None:
    runner = llm.engine.runner
    for layer in runner.attn_layers:
        for cache in layer.kv_cache:
            cache.fill_(float("nan"))
    runner._zeroed_blocks = 0  # as if freshly allocated from dirty memory


def test_garbage_in_unwritten_slots_never_reaches_outputs(make_tiny_llama):
    folder, _ = make_tiny_llama()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 31)), [40] * 9]  # partial last blocks everywhere
    # No prefix caching: the second run must compute every block again over the poison.
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, block_size=8, show_progress=False,
              enable_prefix_caching=False)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    _poison(llm)
    dirty = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert dirty == clean
    runner = llm.engine.runner
    used = runner._zeroed_blocks
    assert 0 < used < runner.num_blocks  # zeroed only as far as blocks were handed out
    k_cache = runner.attn_layers[0].kv_cache[0]
    assert torch.isnan(k_cache[used:]).all()


def test_warm_up_profiles_the_sampler_without_touching_the_engines_generator(make_tiny_llama):
    """Sizing the cache runs the sampler over the largest logits pass; unseeded outputs of
    an engine seed must not depend on whether (or at what shape) that ran."""
    folder, _ = make_tiny_llama(seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    outputs = []
    # sized from memory at two shapes (capped by what max_num_seqs full sequences use), and
    # fixed (no warm-up profile)
    for sizing in (dict(num_kv_blocks=64), dict(memory_fraction=0.5), dict(memory_fraction=0.5, max_num_seqs=3)):
        llm = LLM(folder, dtype="float32", seed=5, show_progress=False, **sizing)
        outputs.append(llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


def test_warm_up_is_not_charged_an_earlier_peak_of_the_process(make_tiny_llama):
    """A second engine in one process (a notebook, `bench kv-cache`) measures its own step:
    memory touched and freed before it is not counted as what the step needs."""
    from tessera.runner.warmup import profile_peak_step

    folder, _ = make_tiny_llama()
    llm = LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False)
    big = torch.ones(2**28)  # 1 GiB, resident, then freed: the process's peak RSS stays
    del big
    peak = profile_peak_step(llm.engine.runner, num_tokens=64, num_logit_rows=64)
    assert peak < 2**28, peak  # the tiny model's step needs a few MiB


def test_warm_up_profiles_the_whole_budget_over_several_sequences(make_tiny_llama, monkeypatch):
    """A step may hold max_num_batched_tokens over several sequences even where one sequence
    is shorter (max_model_len 64, budget 256): warm-up profiles all 256 tokens, as prompts of
    at most 64."""
    from tessera.runner import warmup

    folder, _ = make_tiny_llama()
    measured = []
    profile = warmup.profile_peak_step
    monkeypatch.setattr(warmup, "profile_peak_step", lambda runner, num_tokens, rows, **kw: measured.append(
        (num_tokens, kw.get("max_seq_len"))) or profile(runner, num_tokens, rows, **kw))
    with LLM(folder, dtype="float32", max_model_len=64, max_num_batched_tokens=256, max_num_seqs=8,
             memory_fraction=0.05, show_progress=False) as llm:
        assert measured == [(256, 64)]
        profile(llm.engine.runner, 100, 4, max_seq_len=30)  # four prompts (30, 30, 30, 10) run as one step
        inputs = warmup._dummy_inputs(warmup._split(100, 30), 4, 16, torch.device("cpu"))
        assert inputs.attn.seq_lens_list == [30, 30, 30, 10] and inputs.positions[30].item() == 0
        assert inputs.attn.slot_mapping[30].item() == 2 * 16  # each prompt in blocks of its own
