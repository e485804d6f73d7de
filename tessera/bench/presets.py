"""Published model shapes to benchmark with random weights (`tessera bench --preset NAME`):
the config.json as the model's own repository publishes it, written to a folder under the
tessera cache together with the default model's tokenizer, then loaded with
`--load-format dummy`. Nothing is downloaded; the numbers measure the engine at the real
sizes (speed, memory), not the model's outputs, which are noise.

The default model's tokenizer has fewer ids (49152) than these vocabularies; the bench
feeds token ids, not text, and ids the tokenizer does not know detokenize to nothing.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               attention_bias=False, mlp_bias=False, attention_dropout=0.0, initializer_range=0.02,
               rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256, bos_token_id=128000,
               pretraining_tp=1, use_cache=True, torch_dtype="bfloat16")

PRESETS: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       eos_token_id=128001, tie_word_embeddings=False, rope_scaling=None),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, eos_token_id=128001, tie_word_embeddings=True,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
}


def write_preset(name: str, cache_dir: Path, folder: Path | None = None) -> Path:
    """`folder` (default <cache_dir>/presets/<name>/) with config.json and the tokenizer
    files of the default model (whose metadata lives under cache_dir); returns the folder."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    from tessera.config import ModelConfig
    from tessera.models.registry import get_router

    folder = Path(folder) if folder is not None else Path(cache_dir) / "presets" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(PRESETS[name], indent=2) + "\n")
    tokenizer_dir = get_router(ModelConfig(cache_dir=cache_dir)).metadata_dir  # the default model's
    for item in Path(tokenizer_dir).iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)
    return folder
