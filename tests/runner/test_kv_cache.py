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
