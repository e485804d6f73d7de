"""A tiny SmolVLM2 checkpoint (model type "smolvlm": make_tiny_idefics3's shapes) saved as the
released folders are (preprocessor_config.json naming SmolVLMImageProcessor,
processor_config.json with image_seq_len, chat_template.json), and transformers' reference
inputs for it, expanded here with transformers' own SmolVLM layout functions since its
SmolVLMProcessor needs torchvision and num2words."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.multimodal.checkpoints import CHAT_TEMPLATE, IMAGE_TOKEN, TEXT_CONFIG, bpe_tokenizer

FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"
SMOLVLM_SPECIALS = [IMAGE_TOKEN, FAKE, GLOBAL, "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SEQ_LEN = 4  # 56-pixel tiles of 14-pixel patches, shuffled 2 x 2


def make_tiny_smolvlm(folder: Path, corpus: list[str], seed: int = 0) -> torch.nn.Module:
    """SigLIP over 56-pixel tiles of an image resized to at most 112 pixels, plus its whole
    view; 2 x 2 pixel shuffle, 4 tokens per tile; a Llama language model."""
    from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

    tokenizer = bpe_tokenizer(corpus, SMOLVLM_SPECIALS, image_token=IMAGE_TOKEN, fake_image_token=FAKE,
                              global_image_token=GLOBAL)
    config = SmolVLMConfig(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=56, patch_size=14),
                           text_config=LlamaConfig(**TEXT_CONFIG).to_dict(),
                           image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), scale_factor=2)
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    SmolVLMImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56}).save_pretrained(folder)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    settings["image_processor_type"] = "SmolVLMImageProcessor"  # (the released files' name)
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ_LEN,
                                                              "processor_class": "SmolVLMProcessor"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model


def hf_smolvlm_inputs(folder: Path, text: str, images: list) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The prompt's ids and the model's pixel inputs as SmolVLMProcessor makes them: its image
    processor's tiles, and each placeholder replaced by transformers' SmolVLM layout."""
    from transformers import AutoTokenizer, SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import _prompt_single_image, _prompt_split_image

    out = SmolVLMImageProcessorPil.from_pretrained(str(folder))([images], return_row_col_info=True,
                                                                 return_tensors="pt")
    pieces = text.split(IMAGE_TOKEN)
    expanded = pieces[0]
    for rows, cols, piece in zip(out["rows"][0], out["cols"][0], pieces[1:]):
        layout = (_prompt_single_image(SEQ_LEN, FAKE, IMAGE_TOKEN, GLOBAL) if rows == cols == 0
                  else _prompt_split_image(SEQ_LEN, rows, cols, FAKE, IMAGE_TOKEN, GLOBAL))
        expanded += layout + piece
    ids = AutoTokenizer.from_pretrained(str(folder))(expanded).input_ids
    return list(ids), {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}


def hf_smolvlm_generate(model: torch.nn.Module, folder: Path, text: str, images: list, n: int
                        ) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens (EOS off): (prompt ids, new ids)."""
    ids, pixels = hf_smolvlm_inputs(folder, text, images)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), **pixels, max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


def hf_smolvlm_logprobs(model: torch.nn.Module, folder: Path, text: str, images: list, tokens: list[int]
                        ) -> list[float]:
    """transformers' log-probabilities of `tokens` after the prompt, from one forward pass."""
    ids, pixels = hf_smolvlm_inputs(folder, text, images)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens]), **pixels).logits[0].float()
    logp = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
