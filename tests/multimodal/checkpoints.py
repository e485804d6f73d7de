"""Tiny random multimodal checkpoints saved as real Hugging Face folders (model, processor,
tokenizer with an image token, a chat template with image parts), and images to show them."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

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


def image_tokenizer(corpus: list[str]):
    """A byte-level BPE tokenizer whose specials include the image token (id 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", IMAGE_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   extra_special_tokens={"image_token": IMAGE_TOKEN})
    fast.add_bos_token = True
    return fast


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
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    logp = torch.log_softmax(logits[prompt.shape[1] - 1:-1], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
