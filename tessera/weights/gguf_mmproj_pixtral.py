"""Mistral Small 3.1 / 3.2's vision side from llama.cpp's projector file (clip projector type
"pixtral" with a patch merger), beside its language model's GGUF (arch "llama" or
"mistral3": a Mistral or Llama text config).

The folder made is the one the Hugging Face checkpoint has: config.json for
`Mistral3ForConditionalGeneration` (the Pixtral tower's shape from `clip.vision.*`, its
activation from use_silu / use_gelu, 2 x 2 merging unless `clip.vision.spatial_merge_size`
says otherwise, projector biases where the file has them), the tokenizer as converted, a
PixtralImageProcessor whose longest edge is the file's image size (1540 pixels for the
released models) with its mean and std, and processor_config.json naming [IMG],
[IMG_BREAK] and [IMG_END]. What the file does not hold, llama.cpp assumes, and so does this:
the tower's 2-D rotary base 10000.

Tensors: the converter permutes the tower's Q and K rows as it does Llama's (interleaved
rotary halves), which are undone; the [IMG_BREAK] row it copies out of the text embedding
(`v.token_embd.img_break`) is the language model's own and is not read again. Pixtral 12B's
projector (no patch merger: a Llava checkpoint) is refused."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tessera.weights.gguf import unpermute_rows
from tessera.weights.gguf_clip import MmprojError, image_mean_std, vision_key
from tessera.weights.gguf_rope import field_value

PROJECTOR_TYPE = "pixtral"
TEXT_TYPES = ("mistral", "llama")
TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
DEFAULT_MERGE = 2
IMG_BREAK = "v.token_embd.img_break"
_LAYER = "vision_tower.transformer.layers"
_BLOCK_NAMES = {"attn_q": "attention.q_proj", "attn_k": "attention.k_proj", "attn_v": "attention.v_proj",
                "attn_out": "attention.o_proj", "ln1": "attention_norm", "ln2": "ffn_norm",
                "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                "ffn_down": "feed_forward.down_proj"}
_GLOBAL_NAMES = {"v.patch_embd": "vision_tower.patch_conv", "v.pre_ln": "vision_tower.ln_pre",
                 "mm.input_norm": "multi_modal_projector.norm",
                 "mm.patch_merger": "multi_modal_projector.patch_merger.merging_layer",
                 "mm.1": "multi_modal_projector.linear_1", "mm.2": "multi_modal_projector.linear_2"}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")


def _vision_config(fields: dict) -> dict[str, Any]:
    def key(name: str) -> Any:
        return vision_key(fields, name)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    silu, gelu = field_value(fields, "clip.use_silu"), field_value(fields, "clip.use_gelu")
    if not silu and not gelu:
        raise MmprojError("the mmproj file says neither clip.use_silu nor clip.use_gelu (the tower's activation)")
    return dict(model_type="pixtral", hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
                num_hidden_layers=int(key("block_count")), num_attention_heads=heads, head_dim=hidden // heads,
                num_channels=3, image_size=int(key("image_size")), patch_size=int(key("patch_size")),
                hidden_act="silu" if silu else "gelu", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def write_mistral3_folder(folder: Path, text_folder: Path, fields: dict, tensors: list) -> None:
    """config.json, the tokenizer, the image processor and processor_config.json of the
    Mistral 3 checkpoint the files were converted from, into `folder`."""
    from transformers import Mistral3Config, PixtralImageProcessor, PreTrainedTokenizerFast

    text = json.loads((text_folder / "config.json").read_text())
    if text.get("model_type") not in TEXT_TYPES:
        raise MmprojError(f"a pixtral projector goes with the GGUF of Mistral Small 3.1 / 3.2 (a mistral or llama "
                          f"text model), not a {text.get('model_type')} one")
    names = {t.name for t in tensors}
    if "mm.patch_merger.weight" not in names:
        raise MmprojError("a pixtral projector without a patch merger (Pixtral 12B's, a Llava checkpoint) is not read")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(text_folder))
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in TOKENS.items()}
    missing = [TOKENS[n] for n, i in ids.items() if not isinstance(i, int) or i == tokenizer.unk_token_id]
    if missing:
        raise MmprojError(f"the GGUF's vocabulary lacks Pixtral's image tokens {missing}")
    vision = _vision_config(fields)
    merge = int(field_value(fields, "clip.vision.spatial_merge_size") or DEFAULT_MERGE)
    text_config = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    Mistral3Config(vision_config=vision, text_config=text_config, image_token_index=ids["image_token"],
                   spatial_merge_size=merge, vision_feature_layer=-1, projector_hidden_act="gelu",
                   multimodal_projector_bias="mm.1.bias" in names,
                   tie_word_embeddings=bool(text.get("tie_word_embeddings")),
                   architectures=["Mistral3ForConditionalGeneration"]).save_pretrained(str(folder))
    mean, std = image_mean_std(fields)
    PixtralImageProcessor(size={"longest_edge": vision["image_size"]}, patch_size=vision["patch_size"],
                          image_mean=mean, image_std=std).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        **TOKENS, "patch_size": vision["patch_size"], "processor_class": "PixtralProcessor",
        "spatial_merge_size": merge}))


def iter_pixtral_weights(fields: dict, tensors: list, read) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for the tower's and projector's tensors; `read`
    dequantizes one (a gguf ReaderTensor) to a float32 array of its torch shape."""
    heads = int(field_value(fields, "clip.vision.attention.head_count") or 0)
    for tensor in tensors:
        if tensor.name == IMG_BREAK:
            continue
        array = read(tensor)
        m = _BLOCK_RE.match(tensor.name)
        if m and m.group(2) in _BLOCK_NAMES:
            layer, part, kind = m.groups()
            if part in ("attn_q", "attn_k"):
                array = unpermute_rows(array, heads)
            yield f"{_LAYER}.{layer}.{_BLOCK_NAMES[part]}.{kind}", torch.from_numpy(np.ascontiguousarray(array))
            continue
        stem, _, kind = tensor.name.rpartition(".")
        if stem not in _GLOBAL_NAMES:
            raise MmprojError(f"tensor {tensor.name} has no place in the Pixtral tower or projector")
        yield f"{_GLOBAL_NAMES[stem]}.{kind}", torch.from_numpy(array)
