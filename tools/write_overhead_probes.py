"""Write small random checkpoints (256 wide, 16 layers, a 512-token vocabulary) of the
families whose CPU decode steps replay from kernel graphs: their steps are mostly the per-op
cost the graphs remove, so `tessera bench latency --model DIR/NAME` with and without
`--enforce-eager` shows that overhead (docs/benchmarks.md, session 40).

    python tools/write_overhead_probes.py [DIR] [--only olmo2,gemma4]

Weights are random bf16 (transformers' initialisation); the tokenizer is a byte-level BPE
trained here on a few sentences (nothing downloaded).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers as T

COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=16, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256, "llama_4_scaling_beta": 0.1,
        "rope_theta": 1e6, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# name -> (config class, model class, fields beyond COMMON)
PROBES = {
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    "cohere2": (T.Cohere2Config, T.Cohere2ForCausalLM,
                dict(sliding_window=256, layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 4)),
    "ministral3": (T.Ministral3Config, T.Ministral3ForCausalLM, dict(head_dim=32, rope_parameters=YARN)),
    "deepseek_v2": (T.DeepseekV2Config, T.DeepseekV2ForCausalLM, dict(
        moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1,
        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=None,
        n_shared_experts=2, topk_method="greedy", n_group=1, topk_group=1, num_key_value_heads=8)),
    "falcon_h1": (T.FalconH1Config, T.FalconH1ForCausalLM, dict(
        mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
        head_dim=32, mamba_rms_norm=False, lm_head_multiplier=0.5, embedding_multiplier=3.0,
        mlp_multipliers=[0.7, 1.3], key_multiplier=0.8, attention_out_multiplier=0.9, attention_in_multiplier=1.1,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], ssm_in_multiplier=1.4, ssm_out_multiplier=0.7)),
    "nemotron_3": (T.NemotronHConfig, T.NemotronHForCausalLM, dict(
        layers_block_type=(["linear_attention", "moe"] * 3 + ["full_attention", "moe"]) * 2, mamba_num_heads=8,
        mamba_head_dim=64, ssm_state_size=64, n_groups=1, head_dim=32, n_routed_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=128, moe_shared_expert_intermediate_size=256, n_group=1, topk_group=1,
        routed_scaling_factor=2.5)),
    "gemma4": (T.Gemma4TextConfig, T.Gemma4ForCausalLM, dict(  # E2B's shape: per-layer inputs, KV sharing
        head_dim=32, global_head_dim=64, layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 4,
        num_kv_shared_layers=4, hidden_size_per_layer_input=64, vocab_size_per_layer_input=512,
        sliding_window=512, use_double_wide_mlp=True, pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}})),
}
CORPUS = ["the quick brown fox jumps over the lazy dog", "a decode step replays its kernels from C",
          "small models pay for every python call", "prefill runs eagerly and decode replays"] * 50


def tokenizer() -> T.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="probes")
    parser.add_argument("--only", default=",".join(PROBES))
    args = parser.parse_args()
    tok = tokenizer()
    for name in args.only.split(","):
        config_cls, model_cls, extra = PROBES[name]
        folder = Path(args.folder) / name
        torch.manual_seed(0)
        model_cls(config_cls(**{**COMMON, **extra})).to(torch.bfloat16).save_pretrained(folder)
        tok.save_pretrained(folder)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
