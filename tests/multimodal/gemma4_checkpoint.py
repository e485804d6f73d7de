"""A tiny Gemma 4 image-text checkpoint (tests/models/test_gemma4.py's "e2b" language model,
a vision tower and, for the small releases' layout, an audio tower) and transformers'
reference inputs for it, expanded here since transformers' Gemma 4 processor needs
torchvision."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.multimodal.checkpoints import CHAT_TEMPLATE, bpe_tokenizer


# the released tokenizer's: boi, image, eoi, end of turn, audio
GEMMA4_SPECIALS = ["<|image>", "<|image|>", "<image|>", "<turn|>", "<|audio|>"]
GEMMA4_IMAGE = "<|image|>"  # the prompt's placeholder, expanded to boi + tokens + eoi


def make_tiny_gemma4(folder: Path, corpus: list[str], seed: int = 0, bidirectional: bool = True,
                     audio: bool = False, text_case: str = "e2b", pooling: int = 2, max_soft_tokens: int = 70,
                     clipped: bool = False) -> torch.nn.Module:
    """A Gemma 4 checkpoint (tests/models/test_gemma4.py's "e2b" language model: per-layer
    embeddings, KV sharing, a window of 8) with its vision tower over 4-pixel patches pooled
    2 x 2, at most 70 tokens an image; `bidirectional`: the larger releases' image tokens
    that see each other on sliding layers; `audio`: the small releases' audio tower too;
    `text_case` another of test_gemma4.py's language models ("moe": no per-layer embeddings,
    as the larger releases); `clipped`: the tower's clipped linears (with bounds that clip)
    and standardized output. Saved with the tokenizer (its named image tokens) and
    transformers' PIL image processor."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig
    from transformers import Gemma4VisionConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from tests.models.test_gemma4 import BASE, CASES, draw_scales

    tokenizer = bpe_tokenizer(corpus, GEMMA4_SPECIALS, boi_token=GEMMA4_SPECIALS[0], image_token=GEMMA4_IMAGE,
                              eoi_token=GEMMA4_SPECIALS[2])
    tokenizer.add_bos_token = True
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", GEMMA4_IMAGE)
    ids = tokenizer.convert_tokens_to_ids(GEMMA4_SPECIALS)
    text = Gemma4TextConfig(**{**BASE, **CASES[text_case]},
                            use_bidirectional_attention="vision" if bidirectional else None)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, position_embedding_size=64, patch_size=4,
                                pooling_kernel_size=pooling, use_clipped_linears=clipped, standardize=clipped)
    audio_config = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     subsampling_conv_channels=[8, 4], output_proj_dims=32) if audio else None
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio_config, eos_token_id=[2, ids[3]],
                          boi_token_id=ids[0], image_token_id=ids[1], eoi_token_id=ids[2], audio_token_id=ids[4],
                          video_token_id=None)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        draw_scales(model, g)
        if clipped:
            _draw_clips(model.model.vision_tower, g)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=pooling, max_soft_tokens=max_soft_tokens
                            ).save_pretrained(folder)
    return model


def _draw_clips(tower: torch.nn.Module, g: torch.Generator) -> None:
    """Bounds that clip some of each clipped linear's inputs and outputs, and a drawn
    standardization (the init's are no-ops)."""
    for name, buffer in tower.named_buffers():
        bound = {"input_max": 0.5, "input_min": -0.5, "output_max": 0.3, "output_min": -0.3}.get(name.rsplit(".", 1)[-1])
        if bound is not None:
            buffer.fill_(bound)
    tower.std_bias.copy_(0.1 * torch.randn(tower.std_bias.shape, generator=g))
    tower.std_scale.copy_(1.0 + 0.2 * torch.randn(tower.std_scale.shape, generator=g))


def hf_gemma4_inputs(folder: Path, text: str, images: list) -> dict:
    """transformers' Gemma4ForConditionalGeneration inputs for a prompt, expanded as its
    processor does (which needs torchvision here): boi + one token per pooled patch + eoi."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    inputs = {}
    if images:
        out = AutoImageProcessor.from_pretrained(str(folder))(images=images, return_tensors="pt")
        pieces = text.split(GEMMA4_IMAGE)
        text = pieces[0] + "".join(
            f"{tokenizer.boi_token}{GEMMA4_IMAGE * n}{tokenizer.eoi_token}{piece}"
            for n, piece in zip(out["num_soft_tokens_per_image"].tolist(), pieces[1:]))
        inputs = {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}
    ids = torch.tensor([tokenizer(text).input_ids])
    image_id = tokenizer.convert_tokens_to_ids(GEMMA4_IMAGE)
    return {"input_ids": ids, "mm_token_type_ids": (ids == image_id).long(), **inputs}


def hf_gemma4_generate(model: torch.nn.Module, folder: Path, text: str, images: list, n: int) -> tuple[list, list]:
    """(prompt ids, transformers' greedy new ids) with EOS off."""
    inputs = hf_gemma4_inputs(folder, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
