"""Gemma 4's vision side from llama.cpp's projector file (clip projector type "gemma4v"),
beside its language model's GGUF (arch gemma4: weights/gguf_gemma4.py).

The folder made is the one the Hugging Face checkpoint has: config.json for
`Gemma4ForConditionalGeneration` (the text GGUF's config as text_config; the vision tower's
shape from `clip.vision.*` and its tensors: KV heads and head size from the attention
tensors, the position table's size, standardization and clipped linears where their tensors
are there), the tokenizer naming its image tokens, and Gemma 4's image processor. The audio
tower is not read (tessera serves no audio).

What the file does not hold, the released checkpoints have, and so does this: 280 soft
tokens an image at most, pooled 3 x 3 (unless `clip.vision.projector.scale_factor` says),
and, for the larger releases (no per-layer embeddings: 26B A4B, 31B), an image's tokens
seeing each other on the sliding layers (use_bidirectional_attention "vision"; E2B and E4B
read them causally).

Tensors: gguf's TensorNameMap names them after the converter's renaming; the patch
embedding, written as a convolution's [out, 3, p, p], is the linear's [out, p * p * 3] again,
and the clipped linears' bounds, written as 1-element tensors, are scalars again."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from tessera.weights.gguf_clip import MmprojError, torch_shape, vision_key
from tessera.weights.gguf_rope import field_value

PROJECTOR_TYPE = "gemma4v"
TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"}
AUDIO_TOKEN = "<|audio|>"
MAX_SOFT_TOKENS = 280  # the released processor's
DEFAULT_POOLING = 3
CLAMPS = (".input_max", ".input_min", ".output_max", ".output_min")  # a clipped linear's bounds
PATCH_EMBED = "v.patch_embd.weight"
AUDIO_PREFIXES = ("a.", "mm.a.")  # gguf's names for an audio tower and its projector


def _vision_config(fields: dict, tensors: list) -> dict[str, Any]:
    by_name = {t.name: t for t in tensors}
    hidden, heads = int(vision_key(fields, "embedding_length")), int(vision_key(fields, "attention.head_count"))
    q, k = by_name.get("v.blk.0.attn_q.weight"), by_name.get("v.blk.0.attn_k.weight")
    positions = by_name.get("v.position_embd.weight")
    if q is None or k is None or positions is None:
        raise MmprojError("the mmproj file lacks v.blk.0.attn_q / attn_k or v.position_embd (a Gemma 4 tower's)")
    head_dim = torch_shape(q)[0] // heads
    return dict(model_type="gemma4_vision", hidden_size=hidden,
                intermediate_size=int(vision_key(fields, "feed_forward_length")),
                num_hidden_layers=int(vision_key(fields, "block_count")), num_attention_heads=heads,
                num_key_value_heads=torch_shape(k)[0] // head_dim, head_dim=head_dim,
                patch_size=int(vision_key(fields, "patch_size")), position_embedding_size=torch_shape(positions)[1],
                pooling_kernel_size=int(field_value(fields, "clip.vision.projector.scale_factor") or DEFAULT_POOLING),
                rms_norm_eps=float(vision_key(fields, "attention.layer_norm_epsilon")),
                standardize="v.std_bias" in by_name, use_clipped_linears=any(n.endswith(CLAMPS) for n in by_name))


def write_gemma4_folder(folder: Path, text_folder: Path, fields: dict, tensors: list) -> None:
    """config.json, the tokenizer and the image processor of the Gemma 4 checkpoint the files
    were converted from, into `folder`."""
    from transformers import Gemma4Config, PreTrainedTokenizerFast
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    text = json.loads((text_folder / "config.json").read_text())
    if text.get("model_type") != "gemma4_text":
        raise MmprojError(f"a Gemma 4 projector goes with a Gemma 4 GGUF, not a {text.get('model_type')} one")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(text_folder), extra_special_tokens=TOKENS)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in TOKENS.items()}
    missing = [TOKENS[n] for n, i in ids.items() if not isinstance(i, int) or i == tokenizer.unk_token_id]
    if missing:
        raise MmprojError(f"the GGUF's vocabulary lacks Gemma 4's image tokens {missing}")
    audio = tokenizer.convert_tokens_to_ids(AUDIO_TOKEN)
    vision = _vision_config(fields, tensors)
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    # the larger releases' image tokens see each other (on sliding layers); E2B / E4B's do not
    text["use_bidirectional_attention"] = None if text.get("hidden_size_per_layer_input") else "vision"
    Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=ids["boi_token"],
                 image_token_id=ids["image_token"], eoi_token_id=ids["eoi_token"],
                 audio_token_id=audio if isinstance(audio, int) and audio != tokenizer.unk_token_id else None,
                 video_token_id=None, eos_token_id=text.get("eos_token_id"),
                 tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
                 architectures=["Gemma4ForConditionalGeneration"]).save_pretrained(str(folder))
    mean = field_value(fields, "clip.vision.image_mean") or [0.0, 0.0, 0.0]
    std = field_value(fields, "clip.vision.image_std") or [1.0, 1.0, 1.0]
    Gemma4ImageProcessorPil(patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"],
                            max_soft_tokens=MAX_SOFT_TOKENS, image_mean=list(mean), image_std=list(std)
                            ).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _converted(name: str) -> str:
    """A Hugging Face name as the converter renames it before gguf's TensorNameMap."""
    name = "model." + name.removeprefix("model.")
    name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    if name.endswith(("layer_scalar", "position_embedding_table")):
        name += ".weight"
    return name


def gemma4_tensor_names(hf_names: Iterable[str], num_blocks: int) -> dict[str, str]:
    """{llama.cpp name: the Hugging Face name} for the vision side's weights and buffers."""
    from gguf import MODEL_ARCH, TensorNameMap

    table = TensorNameMap(MODEL_ARCH.MMPROJ, num_blocks)
    out = {}
    for hf in hf_names:
        name = table.get_name(_converted(hf), try_suffixes=(".weight", ".bias", *CLAMPS))
        if name is None:
            raise MmprojError(f"{hf}: no llama.cpp name for it")
        out[name] = hf
    return out


def iter_gemma4_weights(fields: dict, tensors: list, hf_names: Iterable[str], read
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every vision tensor of the projector file
    (audio ones are skipped); `read` dequantizes one to a float32 array of its torch shape."""
    names = gemma4_tensor_names(hf_names, int(vision_key(fields, "block_count")))
    for tensor in tensors:
        if tensor.name.startswith(AUDIO_PREFIXES):
            continue  # the audio tower's and its projector's
        hf = names.get(tensor.name)
        if hf is None:
            raise MmprojError(f"tensor {tensor.name} has no place in Gemma 4's vision tower")
        array = read(tensor)
        if tensor.name == PATCH_EMBED:  # [out, 3, p, p] -> the linear's [out, p * p * 3]
            array = np.ascontiguousarray(array.transpose(0, 2, 3, 1)).reshape(array.shape[0], -1)
        elif tensor.name.endswith(CLAMPS):
            array = array.reshape(())
        yield hf, torch.from_numpy(array)
