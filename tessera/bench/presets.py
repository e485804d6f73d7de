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
from dataclasses import dataclass, field
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

# openai/gpt-oss-20b: its MXFP4 experts stay packed on CPUs (~13 GB in all)
PRESETS["gpt-oss-20b"] = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, attention_dropout=0.0,
    eos_token_id=200002, pad_token_id=199999, experts_per_token=4, num_experts_per_tok=4, head_dim=64,
    hidden_act="silu", hidden_size=2880, intermediate_size=2880, initial_context_length=4096,
    initializer_range=0.02, layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072, num_attention_heads=64, num_hidden_layers=24, num_key_value_heads=8,
    num_local_experts=32, output_router_logits=False, rms_norm_eps=1e-5, router_aux_loss_coef=0.9,
    quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                  "rope_type": "yarn", "truncate": False},
    rope_theta=150000, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    torch_dtype="bfloat16", use_cache=True, vocab_size=201088)

# Qwen/Qwen3-30B-A3B: 128 experts a layer, 8 per token (3.3B of 30.5B weights active); in
# bf16 ~61 GB, with --quantization int4 ~19 GB (its experts in int4 too)
PRESETS["qwen3-30b-a3b"] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1, head_dim=128, hidden_act="silu",
    hidden_size=2048, intermediate_size=6144, initializer_range=0.02, max_position_embeddings=40960,
    max_window_layers=48, mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True,
    num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
    output_router_logits=False, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0,
    router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
    use_cache=True, use_sliding_window=False, vocab_size=151936)

# Qwen/Qwen3.5-0.8B's language model (its text_config; the release is an image-text model):
# 18 Gated DeltaNet layers and 6 gated attention layers
PRESETS["qwen3.5-0.8b"] = dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_act="silu", hidden_size=1024,
    intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    attention_bias=False, attn_output_gate=True, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=248320,
    eos_token_id=248044, torch_dtype="bfloat16",
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})

# LiquidAI/LFM2-1.2B: 10 gated short-convolution layers, 6 attention layers
PRESETS["lfm2-1.2b"] = dict(
    architectures=["Lfm2ForCausalLM"], model_type="lfm2", hidden_size=2048, intermediate_size=12288,
    block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
    layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    max_position_embeddings=128000, rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=65536,
    bos_token_id=1, eos_token_id=7, pad_token_id=0, torch_dtype="bfloat16")

# allenai/OLMo-2-0425-1B: norms after each sublayer, RMSNorms over the whole q / k projections
PRESETS["olmo-2-1b"] = dict(
    architectures=["Olmo2ForCausalLM"], model_type="olmo2", hidden_act="silu", hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
    attention_bias=False, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000,
    tie_word_embeddings=False, vocab_size=100352, pad_token_id=100277, eos_token_id=100257, torch_dtype="bfloat16")

# Qwen/Qwen3-Embedding-0.6B (an embedding model: last-token pooling, normalized)
PRESETS["qwen3-embedding-0.6b"] = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000, rope_scaling=None, sliding_window=None, use_sliding_window=False,
    max_window_layers=28, tie_word_embeddings=True, vocab_size=151669, bos_token_id=151643,
    eos_token_id=151643, torch_dtype="bfloat16")

# BAAI/bge-base-en-v1.5 (a BERT encoder: CLS pooling, normalized)
PRESETS["bge-base-en-v1.5"] = dict(
    architectures=["BertModel"], model_type="bert", hidden_act="gelu", hidden_size=768, intermediate_size=3072,
    num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2,
    vocab_size=30522, layer_norm_eps=1e-12, pad_token_id=0, position_embedding_type="absolute",
    initializer_range=0.02, torch_dtype="float32")

# nomic-ai/modernbert-embed-base (ModernBERT-base: 22 layers, every third global, the others
# 64 tokens each side; mean pooling, normalized)
PRESETS["modernbert-embed-base"] = dict(
    architectures=["ModernBertModel"], model_type="modernbert", hidden_activation="gelu", hidden_size=768,
    intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12, max_position_embeddings=8192,
    vocab_size=50368, norm_eps=1e-5, norm_bias=False, attention_bias=False, mlp_bias=False,
    global_attn_every_n_layers=3, local_attention=128, global_rope_theta=160000.0, local_rope_theta=10000.0,
    classifier_pooling="mean", pad_token_id=50283, bos_token_id=50281, eos_token_id=50282,
    cls_token_id=50281, sep_token_id=50282, initializer_range=0.02, torch_dtype="float32")

# nomic-ai/nomic-embed-text-v1.5 (NomicBERT: 12 post-norm layers, rotary, SwiGLU, no biases;
# mean pooling; its folder's config uses the remote code's keys, these are transformers')
PRESETS["nomic-embed-text-v1.5"] = dict(
    architectures=["NomicBertModel"], model_type="nomic_bert", hidden_act="silu", hidden_size=768,
    intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=2048,
    type_vocab_size=2, vocab_size=30528, layer_norm_eps=1e-12, pad_token_id=0,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.02, torch_dtype="float32")

# BAAI/bge-reranker-base (an XLM-RoBERTa cross-encoder: one label, the CLS row)
PRESETS["bge-reranker-base"] = dict(
    architectures=["XLMRobertaForSequenceClassification"], model_type="xlm-roberta", hidden_act="gelu",
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=514, type_vocab_size=1, vocab_size=250002, layer_norm_eps=1e-5, pad_token_id=1,
    bos_token_id=0, eos_token_id=2, position_embedding_type="absolute", id2label={"0": "LABEL_0"},
    label2id={"LABEL_0": 0}, initializer_range=0.02, torch_dtype="float32")

# Qwen/Qwen2.5-VL-3B-Instruct (its token ids are set where the tokenizer gets the tokens)
PRESETS["qwen2.5-vl-3b"] = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", hidden_act="silu",
    hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
    sliding_window=32768, use_sliding_window=False, max_window_layers=70, tie_word_embeddings=True,
    vocab_size=151936, initializer_range=0.02, torch_dtype="bfloat16",
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    vision_config=dict(depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16,
                       in_chans=3, out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                       spatial_patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                       tokens_per_second=2, temporal_patch_size=2))

# google/gemma-3-4b-it (its token ids are set where the tokenizer gets the tokens); the text
# config leaves heads (8, 4 KV), head_dim 256, theta 1M (10k local) to Gemma3TextConfig's defaults
PRESETS["gemma-3-4b"] = dict(
    architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", eos_token_id=[1, 106],
    initializer_range=0.02, mm_tokens_per_image=256, torch_dtype="bfloat16",
    text_config=dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                     sliding_window=1024, vocab_size=262208, max_position_embeddings=131072,
                     rope_scaling={"factor": 8.0, "rope_type": "linear"}),
    vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, image_size=896, intermediate_size=4304,
                       num_attention_heads=16, num_hidden_layers=27, patch_size=14, vision_use_head=False))


@dataclass(frozen=True)
class ImagePreset:
    """What a preset that takes images adds to the default model's tokenizer and folder."""

    tokens: dict[str, str]  # config key -> token added to the tokenizer (the config gets its id)
    image_processor: dict   # preprocessor_config.json
    processor: dict | None = None  # processor_config.json, for processors with settings of their own
    # tokenizer attribute -> token, what the model's processor finds them as (Gemma 3's boi_token ...)
    named_tokens: dict[str, str] = field(default_factory=dict)


_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
IMAGE_PRESETS: dict[str, ImagePreset] = {
    "qwen2.5-vl-3b": ImagePreset(
        {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
         "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"},
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
         "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_mean": _CLIP_MEAN,
         "image_std": _CLIP_STD, "do_rescale": True, "do_normalize": True, "do_resize": True,
         "do_convert_rgb": True}),
    "gemma-3-4b": ImagePreset(
        {"boi_token_index": "<start_of_image>", "image_token_index": "<image_soft_token>",
         "eoi_token_index": "<end_of_image>"},
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
         "rescale_factor": 1 / 255, "do_rescale": True, "do_normalize": True, "do_resize": True,
         "do_convert_rgb": True},
        processor={"image_seq_length": 256, "processor_class": "Gemma3Processor"},
        named_tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                      "eoi_token": "<end_of_image>"}),
}


def write_preset(name: str, cache_dir: Path, folder: Path | None = None) -> Path:
    """`folder` (default <cache_dir>/presets/<name>/) with config.json and the tokenizer
    files of the default model (whose metadata lives under cache_dir); returns the folder.
    A preset that takes images also gets its image tokens (added to that tokenizer) and its
    image processor's config."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    from tessera.config import ModelConfig
    from tessera.models.registry import get_router

    folder = Path(folder) if folder is not None else Path(cache_dir) / "presets" / name
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(PRESETS[name])
    tokenizer_dir = get_router(ModelConfig(cache_dir=cache_dir)).metadata_dir  # the default model's
    for item in Path(tokenizer_dir).iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)
    if name in IMAGE_PRESETS:
        from transformers import AutoTokenizer

        preset = IMAGE_PRESETS[name]
        tokenizer = AutoTokenizer.from_pretrained(str(folder), extra_special_tokens=preset.named_tokens or None)
        tokenizer.add_special_tokens({"additional_special_tokens": list(preset.tokens.values())})
        tokenizer.save_pretrained(str(folder))
        config.update({key: tokenizer.convert_tokens_to_ids(token) for key, token in preset.tokens.items()})
        (folder / "preprocessor_config.json").write_text(json.dumps(preset.image_processor, indent=2) + "\n")
        if preset.processor is not None:
            (folder / "processor_config.json").write_text(json.dumps(preset.processor, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
