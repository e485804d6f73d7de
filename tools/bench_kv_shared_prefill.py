"""Usage: python tools/bench_kv_shared_prefill.py PROMPT_TOKENS [STEP_TOKENS]

Prefill time (TTFT) of a Gemma-4-shaped model with KV-shared layers (random weights, bf16):
the shared layers run for the rows the LM head reads (tessera's default) vs for every row
(the runner's output rows switched off), engines alternated, medians of 3.

The shape is the one third-party write-ups give for Gemma 4 E2B (35 layers, hidden 1536,
8 query heads over 1 KV head, heads 256 / 512 wide, a 4:1 sliding:full pattern, per-layer
embeddings of 256), not read from the checkpoint; 20 shared layers and a 6144-wide MLP are
assumptions, and the vocabulary is cut to 32768 (the embedding tables do not enter prefill)."""
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tessera import LLM, SamplingParams
from tessera.runner.inputs import ModelInputs

LAYERS = 35
CONFIG = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=1536, intermediate_size=6144,
              num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
              layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (LAYERS // 5), sliding_window=512,
              num_kv_shared_layers=20, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
              vocab_size=32768, vocab_size_per_layer_input=32768, max_position_embeddings=32768,
              hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, final_logit_softcapping=30.0,
              tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16")


def main() -> None:
    prompt_len = int(sys.argv[1])
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    folder = Path.home() / ".cache/tessera/bench-gemma4-kv-shared"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    from tessera.config import ModelConfig
    from tessera.models.registry import get_router

    for item in Path(get_router(ModelConfig()).metadata_dir).iterdir():  # the default model's tokenizer
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", show_progress=False, max_num_seqs=4,
              num_kv_blocks=(prompt_len // 16) + 8, max_num_batched_tokens=step, enable_prefix_caching=False)
    mark = ModelInputs.mark_output_rows
    times: dict[str, list[float]] = {"read rows only": [], "every row": []}
    for r in range(4):
        prompt = np.random.default_rng(r).integers(1000, 30000, prompt_len).tolist()
        for mode in times:
            ModelInputs.mark_output_rows = mark if mode == "read rows only" else (lambda self, hidden_read=True: None)
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            if r:  # the first round warms up
                times[mode].append(time.perf_counter() - start)
    ModelInputs.mark_output_rows = mark
    base = statistics.median(times["every row"])
    for mode, runs in times.items():
        print(f"{mode:>15}: TTFT {statistics.median(runs) * 1e3:7.0f} ms ({prompt_len} tokens in steps of {step}; "
              f"{base / statistics.median(runs):.2f}x) runs {[round(t * 1e3) for t in runs]}")


if __name__ == "__main__":
    main()
