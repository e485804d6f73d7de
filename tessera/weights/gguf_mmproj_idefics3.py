"""SmolVLM's and Idefics3's vision side from llama.cpp's projector file (clip projector type
"idefics3"), beside their language model's GGUF (arch "llama": SmolVLM-256M / 500M /
2.2B-Instruct and SmolVLM2 run SmolLM2 or Llama 3 text models).

The folder made is the one the Hugging Face checkpoint has: config.json for
`Idefics3ForConditionalGeneration` (the SigLIP tower's shape from `clip.vision.*`, the
pixel-shuffle connector's `projector.scale_factor`), the tokenizer as converted, and an
Idefics3Processor whose image processor splits an image into tiles of the tower's image
size plus a downscaled whole view, after resizing its longest edge to the file's
`preproc_image_size` (the released preprocessor's `size.longest_edge`, e.g. 2048 pixels
for SmolVLM-256M; where the file lacks it, one tile's size: no splitting), with the file's
mean and std. An image takes (image_size / patch_size)^2 / scale_factor^2 tokens a tile.

Tensors keep the Hugging Face layout under the names gguf's TensorNameMap gives them (the
converter renames them only), which gguf_mmproj.py reads back."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.weights.gguf_clip import MmprojError, image_mean_std, vision_key
from tessera.weights.gguf_rope import field_value

PROJECTOR_TYPE = "idefics3"
TEXT_TYPES = ("llama",)
# the tokens Idefics3Processor lays an image out with (the row / column tags besides)
IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")
MAX_TILE_GRID = 6  # the processor's <row_R_col_C> tags go up to 6 x 6


def _vision_config(fields: dict) -> dict[str, Any]:
    def key(name: str) -> Any:
        return vision_key(fields, name)

    if not field_value(fields, "clip.use_gelu"):
        raise MmprojError("an idefics3 projector's tower runs GELU: the mmproj file does not say clip.use_gelu")
    return dict(model_type="idefics3_vision", hidden_size=int(key("embedding_length")),
                intermediate_size=int(key("feed_forward_length")), num_hidden_layers=int(key("block_count")),
                num_attention_heads=int(key("attention.head_count")), image_size=int(key("image_size")),
                patch_size=int(key("patch_size")), layer_norm_eps=float(key("attention.layer_norm_epsilon")),
                hidden_act="gelu_pytorch_tanh", num_channels=3)


def tokens_per_tile(vision: dict[str, Any], scale: int) -> int:
    """The tokens one tile (or the whole view) takes after the connector's pixel shuffle."""
    side = vision["image_size"] // vision["patch_size"]
    if vision["image_size"] % vision["patch_size"] or side % scale:
        raise MmprojError(f"the connector shuffles {side} x {side} patches by {scale}: not a whole grid")
    return (side // scale) ** 2


def write_idefics3_folder(folder: Path, text_folder: Path, fields: dict) -> None:
    """config.json, the tokenizer and the processor of the Idefics3 / SmolVLM checkpoint the
    files were converted from, into `folder`."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast

    text = json.loads((text_folder / "config.json").read_text())
    if text.get("model_type") not in TEXT_TYPES:
        raise MmprojError(f"an idefics3 projector goes with the GGUF of a SmolVLM or Idefics3 model (a llama text "
                          f"model), not a {text.get('model_type')} one")
    scale = field_value(fields, "clip.vision.projector.scale_factor")
    if scale is None:
        raise MmprojError("the mmproj file lacks clip.vision.projector.scale_factor (the connector's pixel shuffle)")
    vision = _vision_config(fields)
    tokens = tokens_per_tile(vision, int(scale))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(text_folder))
    wanted = [*IMAGE_TOKENS, *(f"<row_{r}_col_{c}>" for r in range(1, MAX_TILE_GRID + 1)
                               for c in range(1, MAX_TILE_GRID + 1))]
    missing = [t for t in wanted if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise MmprojError(f"the GGUF's vocabulary lacks Idefics3's image tokens {missing[:4]}")
    text_config = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    Idefics3Config(vision_config=vision, text_config=text_config, scale_factor=int(scale),
                   image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                   tie_word_embeddings=bool(text.get("tie_word_embeddings")),
                   architectures=["Idefics3ForConditionalGeneration"]).save_pretrained(str(folder))
    mean, std = image_mean_std(fields)
    tile = vision["image_size"]
    longest = int(field_value(fields, "clip.vision.preproc_image_size") or tile)
    if longest < tile:
        raise MmprojError(f"the mmproj file's preproc_image_size {longest} is under its tiles' {tile} pixels")
    images = Idefics3ImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
                                    image_mean=mean, image_std=std)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=tokens,
                      chat_template=tokenizer.chat_template).save_pretrained(str(folder))
