"""Usage: python tools/bench_multiturn_state.py FIRST_TURN_TOKENS NEW_TOKENS (after one `tessera bench
--preset qwen3.5-0.8b` run wrote the preset folder).

Second-turn TTFT of a conversation on Qwen3.5-0.8B's shapes (random weights), prefix
caching on (state snapshots) vs off; medians of 3, engines alternated."""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tessera import LLM, SamplingParams
PRESET = str(Path.home() / ".cache/tessera/presets/qwen3.5-0.8b")  # tessera bench --preset qwen3.5-0.8b writes it
first_len, new_len, reply = int(sys.argv[1]), int(sys.argv[2]), 32
engines = {c: LLM(PRESET, load_format="dummy", show_progress=False, max_num_seqs=4, num_kv_blocks=1024,
                  max_model_len=8192, enable_prefix_caching=c) for c in (True, False)}
times = {True: [], False: []}
for r in range(3):
    rng = np.random.default_rng(r)
    first = rng.integers(1000, 40000, first_len).tolist()
    new = rng.integers(1000, 40000, new_len).tolist()
    for caching, llm in engines.items():
        out = llm.generate([first], SamplingParams(max_tokens=reply, temperature=0, ignore_eos=True), use_tqdm=False)
        second = first + out[0].outputs[0].token_ids + new
        start = time.perf_counter()
        llm.generate([second], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        times[caching].append(time.perf_counter() - start)
        llm.reset_prefix_cache()
for caching in (True, False):
    print(f"prefix caching {'on ' if caching else 'off'}: second-turn TTFT {statistics.median(times[caching]) * 1e3:.0f} ms "
          f"({first_len}+{reply}+{new_len} tokens) runs {[round(t * 1e3) for t in times[caching]]}")
print("hits", engines[True].engine.block_manager.prefix_hits)
