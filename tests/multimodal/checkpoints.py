"""Tiny random multimodal checkpoints saved as real Hugging Face folders (model, processor,
tokenizer with an image token, a chat template with image parts), and images to show them."""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from tessera.sampling.params import SamplingParams

IMAGE_TOKEN = "<image>"
# renders string content and transformers' content parts, images as the placeholder
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")

TEXT_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# a 28 x 28 image in 7 x 7 patches: 16 patch features per image (the CLS one dropped)
VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     image_size=28, patch_size=7, projection_dim=32)
TOKENS_PER_IMAGE = 16


def bpe_tokenizer(corpus: list[str], specials: list[str], **named: str):
    """A byte-level BPE tokenizer trained on `corpus`: <unk>, <s>, </s>, then `specials`
    (ids 3, 4, ...); `named`: what the processor finds them as (image_token=...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *specials],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   **({"extra_special_tokens": named} if named else {}))


def image_tokenizer(corpus: list[str]):
    """The LLaVA tokenizer: the image token is id 3."""
    fast = bpe_tokenizer(corpus, [IMAGE_TOKEN], image_token=IMAGE_TOKEN)
    fast.add_bos_token = True
    return fast


def greedy(n: int = 16, **kw) -> SamplingParams:
    """Greedy, EOS ignored: `n` tokens exactly."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def image_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def make_tiny_llava(folder: Path, corpus: list[str], text_model_type: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A LLaVA checkpoint (CLIP tower, MLP projector, `text_model_type` language model) with
    its processor; returns transformers' model in float32 eval mode."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(seed)
    text = CONFIG_MAPPING[text_model_type](**TEXT_CONFIG)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION_CONFIG), text_config=text, image_token_id=3,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # norms around 1, so a loader that skipped one would show
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=image_tokenizer(corpus), patch_size=7, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return model


def make_tiny_llava_next(folder: Path, corpus: list[str], seed: int = 0) -> torch.nn.Module:
    """A LLaVA-NeXT checkpoint: LLaVA's tower and projector with anyres tiling (a 28-pixel
    base view plus the tiles of a 28 x 56, 56 x 28 or 56 x 56 grid) and a learned newline
    row: an image's token count depends on its size."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor)

    pinpoints = [[28, 56], [56, 28], [56, 56]]
    config = LlavaNextConfig(vision_config=CLIPVisionConfig(**VISION_CONFIG), text_config=LlamaConfig(**TEXT_CONFIG),
                             image_token_id=3, image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
                             vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_()
    model.save_pretrained(folder)
    LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                image_grid_pinpoints=pinpoints),
        tokenizer=image_tokenizer(corpus), patch_size=7, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return model


def make_tiny_idefics3(folder: Path, corpus: list[str], seed: int = 0) -> torch.nn.Module:
    """An Idefics3 (SmolVLM) checkpoint: SigLIP over 56-pixel tiles of an image resized to at
    most 112 pixels, plus its whole view; 2 x 2 pixel shuffle, 4 tokens per tile."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, LlamaConfig)

    tokenizer = bpe_tokenizer(corpus, [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>"] + [
        f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)], image_token=IMAGE_TOKEN,
        fake_image_token="<fake_token_around_image>", global_image_token="<global-img>")
    config = Idefics3Config(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=56, patch_size=14),
                            text_config=LlamaConfig(**TEXT_CONFIG).to_dict(), image_token_id=3, scale_factor=2)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    Idefics3Processor(image_processor=Idefics3ImageProcessor(size={"longest_edge": 112},
                                                             max_image_size={"longest_edge": 56}),
                      tokenizer=tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return model


def random_image(seed: int, size: tuple[int, int] = (50, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def hf_image_generate(model: torch.nn.Module, folder: Path, text: str, images: list, n: int) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for a prompt with images (EOS off): (prompt ids, new ids)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder))
    inputs = processor(images=images or None, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def hf_image_logprobs(model: torch.nn.Module, folder: Path, text: str, images: list, tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of `tokens` after the prompt, from one forward pass."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder))
    inputs = processor(images=images or None, text=text, return_tensors="pt")
    prompt = inputs["input_ids"]
    inputs["input_ids"] = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "token_type_ids" in inputs:  # (Gemma 3's image mask) the new tokens are text
        inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.zeros(1, len(tokens), dtype=torch.long)], 1)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    logp = torch.log_softmax(logits[prompt.shape[1] - 1:-1], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<image>", QWEN_IMAGE)


def make_tiny_qwen2_vl(folder: Path, corpus: list[str], model_type: str = "qwen2_5_vl", seed: int = 0,
                       tie_word_embeddings: bool = False, vision_overrides: dict | None = None) -> torch.nn.Module:
    """A Qwen2.5-VL (or Qwen2-VL) checkpoint: its vision transformer, 2 x 2 patch merging,
    a Qwen2 language model with M-RoPE sections (2, 3, 3) of head_dim 16; saved with its
    image processor and a tokenizer (transformers' Qwen processor needs torchvision)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor)

    tokenizer = bpe_tokenizer(corpus, QWEN_SPECIALS)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(TEXT_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    if model_type == "qwen2_5_vl":
        vision.update(out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    vision.update(vision_overrides or {})
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


# the Qwen3 vision transformers' tiny shape: 16-pixel patches merged 2 x 2 into 64 wide features
QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)


def _qwen3_vl_checkpoint(folder: Path, corpus: list[str], seed: int, config_cls, model_cls, text: dict,
                         vision: dict, tweak: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """A Qwen3-VL-style checkpoint in `folder`: the Qwen tokenizer with its image tokens (and
    chat template), the model of `text` / `vision` (seeded, then `tweak`ed), and Qwen2-VL's
    image processor at 16-pixel patches."""
    from transformers import Qwen2VLImageProcessor

    tokenizer = bpe_tokenizer(corpus, QWEN_SPECIALS)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        tweak(model)
    model.save_pretrained(folder)
    Qwen2VLImageProcessor(patch_size=16, merge_size=2, min_pixels=64 * 64,
                          max_pixels=32 * 32 * 64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def make_tiny_qwen3_vl(folder: Path, corpus: list[str], seed: int = 0, moe: bool = False) -> torch.nn.Module:
    """A Qwen3-VL checkpoint: its vision transformer over 16-pixel patches with learned
    position embeddings and DeepStack mergers on both layers, 2 x 2 merging, and a Qwen3
    language model (3 layers) with interleaved M-RoPE sections (2, 3, 3) of head_dim 16.
    `moe`: Qwen3-VL-MoE, 4 experts of 24 (top 2) on layers 0 and 2 (layer 1 dense), its
    stacked expert tensors saved as the published checkpoints store them ([E, H, 2I],
    [E, I, H]; transformers 5 saves its own [E, 2I, H], [E, H, I], and reads both)."""
    from safetensors.torch import load_file, save_file
    from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                              Qwen3VLMoeForConditionalGeneration)

    text = dict(TEXT_CONFIG, num_hidden_layers=3, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])

    def larger_deepstack(model: torch.nn.Module) -> None:  # so that a skipped level would show
        for name, p in model.named_parameters():
            if "deepstack_merger_list" in name and name.endswith("linear_fc2.weight"):
                p.mul_(8.0)

    config_cls, model_cls = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                             else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    model = _qwen3_vl_checkpoint(folder, corpus, seed, config_cls, model_cls, text,
                                 dict(QWEN3_VISION, deepstack_visual_indexes=[0, 1]), larger_deepstack)
    if moe:
        tensors = load_file(folder / "model.safetensors")
        stacked = [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert stacked
        save_file({name: t.transpose(1, 2).contiguous() if name in stacked else t for name, t in tensors.items()},
                  folder / "model.safetensors", metadata={"format": "pt"})
    return model


def make_tiny_qwen3_5_vl(folder: Path, corpus: list[str], seed: int = 0, moe: bool = False) -> torch.nn.Module:
    """A Qwen3.5 checkpoint (qwen3_5, or qwen3_5_moe with `moe`): Qwen3-VL's vision
    transformer without DeepStack, and a Qwen3.5 language model of Gated DeltaNet and gated
    attention layers (linear, full, linear, full) whose rotary turns a quarter of each
    32-wide head, in interleaved M-RoPE sections (2, 1, 1)."""
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    text = dict(TEXT_CONFIG, num_hidden_layers=4, head_dim=32, intermediate_size=96,
                layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

    def decays_that_matter(model: torch.nn.Module) -> None:  # (the default init decays slowly and evenly)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(0.5 * torch.randn(p.shape) - 1.0)

    config_cls, model_cls = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                             else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    return _qwen3_vl_checkpoint(folder, corpus, seed, config_cls, model_cls, text, QWEN3_VISION, decays_that_matter)


def _qwen_inputs(folder: Path, text: str, images: list, add_special_tokens: bool) -> tuple[list[int], dict]:
    """A Qwen VL prompt's ids and image inputs as transformers' Qwen processor makes them
    (each <|image_pad|> repeated per merged patch)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    kwargs = {}
    if images:
        out = AutoImageProcessor.from_pretrained(str(folder))(images=images, return_tensors="pt")
        pieces = text.split("<|image_pad|>")
        counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * c + p for c, p in zip(counts, pieces[1:]))
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    prompt = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    kwargs["pad"] = pad
    return prompt, kwargs


def hf_qwen_generate(model: torch.nn.Module, folder: Path, text: str, images: list, n: int,
                     add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for a Qwen VL prompt with images (EOS off)."""
    prompt, kwargs = _qwen_inputs(folder, text, images, add_special_tokens)
    input_ids = torch.tensor([prompt])
    kwargs["mm_token_type_ids"] = (input_ids == kwargs.pop("pad")).int()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return prompt, out[0, len(prompt):].tolist()


def hf_qwen_logprobs(model: torch.nn.Module, folder: Path, text: str, images: list, tokens: list[int]) -> list[float]:
    """transformers' log-probabilities of `tokens` after a Qwen VL prompt, from one forward."""
    prompt, kwargs = _qwen_inputs(folder, text, images, True)
    input_ids = torch.tensor([prompt + tokens])
    kwargs["mm_token_type_ids"] = (input_ids == kwargs.pop("pad")).int()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


GEMMA3_SPECIALS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>", "<end_of_turn>"]
GEMMA3_IMAGE = "<start_of_image>"


def make_tiny_gemma3(folder: Path, corpus: list[str], seed: int = 0, text_overrides: dict | None = None,
                     **top_level) -> torch.nn.Module:
    """A Gemma 3 (4B-27B shape) checkpoint: SigLIP over 7-pixel patches of a 28-pixel image,
    average-pooled 2 x 2 to 4 x 4 = 16 tokens an image, and Gemma 3's language model with a
    sliding window (8) shorter than an image on half its layers; saved with transformers'
    Gemma3Processor (PIL image processor). `top_level`: Gemma3Config's own fields;
    `text_overrides`: its text config's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = bpe_tokenizer(corpus, GEMMA3_SPECIALS, boi_token="<start_of_image>",
                              image_token="<image_soft_token>", eoi_token="<end_of_image>")
    tokenizer.add_bos_token = True
    ids = tokenizer.convert_tokens_to_ids(GEMMA3_SPECIALS[:3])
    text = Gemma3TextConfig(**{**TEXT_CONFIG, "tie_word_embeddings": True, "head_dim": 16, "sliding_window": 8,
                               "query_pre_attn_scalar": 24, "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}},
                               **(text_overrides or {})})
    vision = dict(VISION_CONFIG, model_type="siglip_vision_model")
    vision.pop("projection_dim")
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=ids[0], image_token_index=ids[1], eoi_token_index=ids[2], **top_level)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # norms away from 0 (stored as w of 1 + w), so a skipped one would show
        for name, p in model.named_parameters():
            if ("language_model" in name and name.endswith("norm.weight")) or "mm_soft_emb_norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            if name.endswith("mm_input_projection_weight"):  # transformers starts it at 0: images would not matter
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tokenizer,
                    image_seq_length=TOKENS_PER_IMAGE,
                    chat_template=CHAT_TEMPLATE.replace("<image>", GEMMA3_IMAGE)).save_pretrained(folder)
    return model


PIXTRAL_SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def make_tiny_mistral3(folder: Path, corpus: list[str], seed: int = 0, text_type: str = "mistral",
                       image_size: int = 56) -> torch.nn.Module:
    """A Mistral3 (Mistral Small 3.1) checkpoint: a Pixtral tower over 7-pixel patches of an
    image at most `image_size` (56) pixels long, 2 x 2 merged (14 pixels a token), a Mistral language
    model (`text_type` "ministral3": Ministral 3's, with YaRN and its query temperature from
    16 tokens on; "mistral4": Mistral Small 4's); saved with its image processor, a tokenizer and processor_config.json as
    transformers' PixtralProcessor writes it (the processor itself needs torchvision)."""
    import json

    from transformers import (Ministral3Config, Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig,
                              PixtralImageProcessor, PixtralVisionConfig)

    tokenizer = bpe_tokenizer(corpus, PIXTRAL_SPECIALS)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", "[IMG]")
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=image_size, patch_size=7, head_dim=16)
    if text_type == "ministral3":
        from tests.models.families import MINISTRAL3_ROPE
        text = Ministral3Config(**TEXT_CONFIG, rope_parameters=MINISTRAL3_ROPE, pad_token_id=0)
    elif text_type == "mistral4":  # Mistral Small 4's: latent attention, experts, the temperature
        from transformers import Mistral4Config

        from tests.models.test_mistral4 import YARN
        text = Mistral4Config(**{**TEXT_CONFIG, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
                              n_routed_experts=4, num_experts_per_tok=2, rope_parameters=dict(YARN), pad_token_id=0)
    else:
        text = MistralConfig(**TEXT_CONFIG)
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=3,
                            spatial_merge_size=2, vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    PixtralImageProcessor(size={"longest_edge": image_size}, patch_size=7).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
        "patch_size": 7, "processor_class": "PixtralProcessor", "spatial_merge_size": 2}))
    return model

