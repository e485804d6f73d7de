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
