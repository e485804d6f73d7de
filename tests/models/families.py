"""Tiny random checkpoints of the Llama-like families whose parity with transformers
test_family_parity.py checks (and whose LoRA and tensor-parallel tests build them too):
each case is a transformers config class, its causal LM, and the overrides that exercise
what the family adds to Llama (NoPE layers, post-norms, query temperature, multipliers,
interleaved partial rotary, parallel blocks). Norm weights are randomised (parity.make_tiny)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.models.parity import make_tiny

# Ministral 3's rope as it ships (YaRN with mscale, Llama 4's query temperature), its
# original context cut to 16 tokens so that prompts and generations cross it
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                   "llama_4_scaling_beta": 0.1}
GRANITE = dict(embedding_multiplier=12.0, attention_multiplier=0.02, residual_multiplier=0.22, logits_scaling=8.0)

# case -> (transformers class prefix, overrides)
CASES: dict[str, tuple[str, dict]] = {
    "smollm3-interval4": ("SmolLM3", dict(num_hidden_layers=4)),
    "smollm3-alternate-tied": ("SmolLM3", dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0],
                                               tie_word_embeddings=True)),
    "smollm3-window8": ("SmolLM3", dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
                                        sliding_window=8)),
    "olmo2-gqa": ("Olmo2", {}),
    "olmo2-mha-tied": ("Olmo2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "olmo3-window8-yarn": ("Olmo3", dict(num_hidden_layers=4, sliding_window=8, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                           "original_max_position_embeddings": 128}})),
    "ministral3-yarn-temperature": ("Ministral3", dict(rope_parameters=MINISTRAL3_ROPE)),
    "ministral3-headdim-tied-window": ("Ministral3", dict(rope_parameters=MINISTRAL3_ROPE, head_dim=24,
                                                          tie_word_embeddings=True, sliding_window=8)),
    # multipliers far from 1, so that a missed one moves the logits well past the tolerance
    "granite-gqa": ("Granite", GRANITE),
    "granite-tied-bias": ("Granite", dict(GRANITE, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "glm4-gqa-bias": ("Glm4", dict(head_dim=16)),
    "glm4-tied-no-bias-quarter": ("Glm4", dict(head_dim=16, tie_word_embeddings=True, attention_bias=False,
                                               partial_rotary_factor=0.25)),
    "cohere2-window8-tied": ("Cohere2", dict(num_hidden_layers=4, sliding_window=8, tie_word_embeddings=True,
                                             logit_scale=0.25)),
    "cohere2-untied-alternate": ("Cohere2", dict(num_hidden_layers=4, sliding_window=8, logit_scale=2.0,
                                                 layer_types=["sliding_attention", "full_attention"] * 2)),
}


def make_family(folder: Path, tokenizer_dir: Path, name: str, seed: int = 0, **more) -> torch.nn.Module:
    """Case `name`'s checkpoint in `folder`; transformers' model, float32, eval."""
    import transformers

    prefix, overrides = CASES[name]
    return make_tiny(folder, tokenizer_dir, getattr(transformers, f"{prefix}Config"),
                     getattr(transformers, f"{prefix}ForCausalLM"), seed=seed, pad_token_id=0, **{**overrides, **more})
