"""Qwen's vision towers from llama.cpp's projector file (clip projector types
"qwen2vl_merger", "qwen2.5vl_merger" and "qwen3vl_merger"), beside their language model's
GGUF (arch qwen2vl, qwen3vl or qwen3vlmoe: gguf_qwen_vl.py; Qwen3.5's qwen35 or qwen35moe:
gguf_qwen35.py, whose tower is Qwen3-VL's without DeepStack, in a qwen3vl_merger file).

The folder made is the one a Hugging Face checkpoint has: config.json for Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 or Qwen3.5-MoE (the text GGUF's config with its M-RoPE sections as
text_config; the tower's shape from `clip.vision.*` and its tensors), the tokenizer as
converted and a Qwen2VLImageProcessor with the file's mean and std and its pixel limits
where it has them, else the released checkpoints' (4 to 16384 merged patches for Qwen2(.5)-VL,
64 to 16384 for Qwen3-VL; llama.cpp's own are 8 to 4096; --mm-processor-kwargs max_pixels
sets them).

What the file does not hold, llama.cpp assumes, and so does this: a temporal patch of 2
(the converter checks it), 2 x 2 merging unless `clip.vision.spatial_merge_size` says
otherwise, Qwen2.5-VL's 112-pixel attention windows (unless `clip.vision.window_size` says)
with full attention in every `n_wa_pattern`-th layer, and Qwen3-VL's interleaved M-RoPE. The
MLPs' width comes from their tensors (Qwen2-VL's file states its merger's width as
feed_forward_length), Qwen3-VL's DeepStack layers from theirs (`v.deepstack.L.*`: the tower
layer L each reads).

Tensors: the converter splits the patch embedding's two temporal kernels
(`v.patch_embd.weight`, `.weight.1`) and Qwen2(.5)-VL's fused qkv into attn_q / attn_k /
attn_v; they are joined back. The rest is renamed."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tessera.weights.gguf_clip import MmprojError, image_mean_std, torch_shape, vision_key
from tessera.weights.gguf_qwen_vl import DEEPSTACK_LAYERS, MROPE_SECTION
from tessera.weights.gguf_rope import field_value

# projector type -> {its text GGUF's model type: the Hugging Face model type rebuilt}
QWEN_PROJECTORS = {"qwen2vl_merger": {"qwen2": "qwen2_vl"}, "qwen2.5vl_merger": {"qwen2": "qwen2_5_vl"},
                   "qwen3vl_merger": {"qwen3": "qwen3_vl", "qwen3_moe": "qwen3_vl_moe",
                                      "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}}
WINDOW_PIXELS = 112  # Qwen2.5-VL's attention window, which llama.cpp fixes (every released size has it)
TEMPORAL_PATCH = 2
DEFAULT_MERGE = 2
MAX_MERGED_PATCHES = 16384  # the released preprocessor_config.json's max pixels
MIN_MERGED_PATCHES = {"qwen2_vl": 4, "qwen2_5_vl": 4, "qwen3_vl": 64}  # ... and min pixels
SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                 "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
WITHOUT_DEEPSTACK = ("qwen3_5", "qwen3_5_moe")  # Qwen3-VL's tower, no DeepStack mergers

# llama.cpp name -> the Hugging Face one, per tower (the MoE model's is Qwen3-VL's)
_BLOCK_NAMES = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}
_TOWER_BLOCK_NAMES = {
    "qwen2_vl": {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
    "qwen2_5_vl": {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    "qwen3_vl": {"attn_qkv": "attn.qkv", "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"},
}
_QWEN2_MERGER = {"v.post_ln": "visual.merger.ln_q", "mm.0": "visual.merger.mlp.0", "mm.2": "visual.merger.mlp.2"}
_TOWER_NAMES = {
    "qwen2_vl": _QWEN2_MERGER, "qwen2_5_vl": _QWEN2_MERGER,
    "qwen3_vl": {"v.post_ln": "visual.merger.norm", "mm.0": "visual.merger.linear_fc1",
                 "mm.2": "visual.merger.linear_fc2", "v.position_embd": "visual.pos_embed",
                 "v.patch_embd": "visual.patch_embed.proj"},  # (.bias only: the weight is joined)
}
_DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_DEEPSTACK_RE = re.compile(r"^v\.deepstack\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
PATCH_EMBED = "v.patch_embd.weight"


def tower_of(model_type: str) -> str:
    """The vision tower a model type has (Qwen3-VL-MoE's and Qwen3.5's are Qwen3-VL's)."""
    return "qwen3_vl" if model_type in WITHOUT_DEEPSTACK else model_type.removesuffix("_moe")


def deepstack_layers(tensors: list) -> list[int]:
    """The tower layers Qwen3-VL's DeepStack mergers read, from their tensors."""
    return sorted({int(m.group(1)) for t in tensors if (m := _DEEPSTACK_RE.match(t.name))})


def _vision_config(fields: dict, tensors: list, model_type: str, text_hidden: int) -> dict[str, Any]:
    def key(name: str) -> Any:
        return vision_key(fields, name)

    tower = tower_of(model_type)
    by_name = {t.name: t for t in tensors}
    up = by_name.get("v.blk.0.ffn_up.weight")
    if up is None:
        raise MmprojError("the mmproj file lacks v.blk.0.ffn_up.weight")
    width, embed = torch_shape(up)
    depth, heads, patch = int(key("block_count")), int(key("attention.head_count")), int(key("patch_size"))
    if embed != int(key("embedding_length")):
        raise MmprojError(f"v.blk.0.ffn_up.weight is {width} x {embed}, for a tower of width {key('embedding_length')}")
    merge = int(field_value(fields, "clip.vision.spatial_merge_size") or DEFAULT_MERGE)
    projection = int(field_value(fields, "clip.vision.projection_dim") or text_hidden)
    if projection != text_hidden:
        raise MmprojError(f"the projector makes {projection}-wide features for a language model of width {text_hidden}")
    common = dict(depth=depth, num_heads=heads, patch_size=patch, spatial_merge_size=merge,
                  temporal_patch_size=TEMPORAL_PATCH, in_channels=3)
    if tower == "qwen2_vl":
        if width % embed:
            raise MmprojError(f"Qwen2-VL's MLP width {width} is not a whole multiple of {embed}")
        return dict(common, embed_dim=embed, mlp_ratio=width // embed, hidden_size=projection, hidden_act="quick_gelu")
    if tower == "qwen3_vl":
        positions = by_name.get("v.position_embd.weight")
        if positions is None:
            raise MmprojError("a Qwen3-VL projector file needs v.position_embd.weight")
        vision = dict(common, hidden_size=embed, intermediate_size=width, out_hidden_size=projection,
                      hidden_act="gelu_pytorch_tanh", num_position_embeddings=torch_shape(positions)[0])
        deepstack = deepstack_layers(tensors)
        if model_type not in WITHOUT_DEEPSTACK:
            return dict(vision, deepstack_visual_indexes=deepstack)
        if deepstack:
            raise MmprojError(f"the projector file has DeepStack mergers (tower layers {deepstack}), which "
                              f"Qwen3.5's language model does not take: it is a Qwen3-VL one")
        return vision
    pattern = int(field_value(fields, "clip.vision.n_wa_pattern") or 0)
    if pattern <= 0:
        raise MmprojError("a Qwen2.5-VL projector file needs clip.vision.n_wa_pattern (its full-attention layers)")
    window = int(field_value(fields, "clip.vision.window_size") or WINDOW_PIXELS)
    return dict(common, hidden_size=embed, intermediate_size=width, out_hidden_size=projection, hidden_act="silu",
                window_size=window, fullatt_block_indexes=[i for i in range(depth) if (i + 1) % pattern == 0])


def _text_config(text_dict: dict, model_type: str, vision: dict) -> dict[str, Any]:
    """The text GGUF's config as the image-text model's text_config."""
    tower = tower_of(model_type)
    sections = text_dict[MROPE_SECTION]
    head_dim = text_dict.get("head_dim") or text_dict["hidden_size"] // text_dict["num_attention_heads"]
    # (Qwen3.5 turns a quarter of each head)
    rotary = int(head_dim * float((text_dict.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)))
    if sum(sections) * 2 != rotary:
        raise MmprojError(f"the M-RoPE sections {sections} do not cover the {rotary} rotary dimensions of a head")
    if tower == "qwen3_vl" and model_type not in WITHOUT_DEEPSTACK:
        levels = len(vision["deepstack_visual_indexes"])
        if text_dict.get(DEEPSTACK_LAYERS, levels) != levels:
            raise MmprojError(f"the GGUF's language model takes {text_dict[DEEPSTACK_LAYERS]} DeepStack levels, "
                              f"the projector file has {levels}")
    text = {k: v for k, v in text_dict.items()
            if k not in ("model_type", "architectures", "transformers_version", MROPE_SECTION, DEEPSTACK_LAYERS)}
    rope = {**dict(text.get("rope_parameters") or {"rope_type": "default"}), "mrope_section": list(sections)}
    if tower == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text["rope_parameters"] = rope
    if model_type == "qwen3_vl_moe" and "num_experts" in text:  # (Qwen3-VL-MoE's text config names them so)
        text["num_local_experts"] = text["num_experts"]
    return text


def write_qwen_vl_folder(folder: Path, text_folder: Path, fields: dict, tensors: list, kind: str) -> None:
    """config.json, the tokenizer and the image processor of the checkpoint the files were
    converted from, into `folder`."""
    from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen2VLImageProcessor

    text_dict = json.loads((text_folder / "config.json").read_text())
    model_type = QWEN_PROJECTORS[kind].get(text_dict.get("model_type"))
    if model_type is None or MROPE_SECTION not in text_dict:
        wanted = " or ".join(sorted(QWEN_PROJECTORS[kind]))
        raise MmprojError(f"a {kind} projector goes with the GGUF of a Qwen image-text model ({wanted}), "
                          f"not a {text_dict.get('model_type')} one")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(text_folder))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if not isinstance(i, int) or i == tokenizer.unk_token_id]
    if missing:
        raise MmprojError(f"the GGUF's vocabulary lacks Qwen's vision tokens {missing}")
    vision = _vision_config(fields, tensors, model_type, int(text_dict["hidden_size"]))
    text = _text_config(text_dict, model_type, vision)
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=bool(text.get("tie_word_embeddings")),
        architectures=[ARCHITECTURES[model_type]])
    config.save_pretrained(str(folder))
    unit = (vision["patch_size"] * vision["spatial_merge_size"]) ** 2
    mean, std = image_mean_std(fields)
    low = field_value(fields, "clip.vision.image_min_pixels") or MIN_MERGED_PATCHES[tower_of(model_type)] * unit
    high = field_value(fields, "clip.vision.image_max_pixels") or MAX_MERGED_PATCHES * unit
    Qwen2VLImageProcessor(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                          temporal_patch_size=TEMPORAL_PATCH, image_mean=mean, image_std=std,
                          size={"shortest_edge": int(low), "longest_edge": int(high)}).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _hf_name(name: str, tower: str, deepstack: list[int]) -> str:
    m = _BLOCK_RE.match(name)
    if m:
        block, part, kind = m.groups()
        mapped = _BLOCK_NAMES.get(part) or _TOWER_BLOCK_NAMES[tower].get(part)
        if mapped is not None:
            return f"visual.blocks.{block}.{mapped}.{kind}"
    m = _DEEPSTACK_RE.match(name)
    if m and tower == "qwen3_vl" and m.group(2) in _DEEPSTACK_NAMES:
        layer, part, kind = m.groups()  # the merger list is in layer order
        return f"visual.deepstack_merger_list.{deepstack.index(int(layer))}.{_DEEPSTACK_NAMES[part]}.{kind}"
    stem, _, kind = name.rpartition(".")
    if stem in _TOWER_NAMES[tower]:
        return f"{_TOWER_NAMES[tower][stem]}.{kind}"
    raise MmprojError(f"tensor {name} has no place in the vision tower")


def iter_qwen_vl_weights(tensors: list, kind: str, read) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the projector file; `read`
    dequantizes one (a gguf ReaderTensor) to a float32 array of its torch shape."""
    tower = tower_of(next(iter(QWEN_PROJECTORS[kind].values())))
    deepstack = deepstack_layers(tensors)
    by_name = {t.name: t for t in tensors}
    pending: dict[str, dict[str, np.ndarray]] = {}  # a block's q / k / v, joined once all three came
    for tensor in tensors:
        name = tensor.name
        if name == PATCH_EMBED + ".1":
            continue
        if name == PATCH_EMBED:
            second = by_name.get(PATCH_EMBED + ".1")
            if second is None:
                raise MmprojError(f"the mmproj file has {PATCH_EMBED} without its second temporal kernel (.1)")
            # [out, in, patch, patch] twice -> Conv3d's [out, in, 2, patch, patch]
            yield "visual.patch_embed.proj.weight", torch.from_numpy(np.stack([read(tensor), read(second)], axis=2))
            continue
        m = _BLOCK_RE.match(name)
        if m and m.group(2) in ("attn_q", "attn_k", "attn_v"):
            block, part, kind_ = m.groups()
            parts = pending.setdefault(f"{block}.{kind_}", {})
            parts[part] = read(tensor)
            if len(parts) == 3:
                joined = np.concatenate([parts["attn_q"], parts["attn_k"], parts["attn_v"]], axis=0)
                del pending[f"{block}.{kind_}"]
                yield f"visual.blocks.{block}.attn.qkv.{kind_}", torch.from_numpy(joined)
            continue
        yield _hf_name(name, tower, deepstack), torch.from_numpy(read(tensor))
    if pending:
        raise MmprojError(f"the mmproj file lacks part of a block's q / k / v: {sorted(pending)[:4]}")
