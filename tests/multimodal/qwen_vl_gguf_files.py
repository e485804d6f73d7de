"""Qwen image-text checkpoints as llama.cpp's convert_hf_to_gguf.py writes them: the language
model's GGUF (arch qwen2vl / qwen3vl / qwen3vlmoe, Q and K unpermuted, M-RoPE sections as four
numbers, Qwen3-VL's DeepStack depth; Qwen3.5's qwen35 / qwen35moe as test_gguf_qwen35.py
writes them) and the projector file (`--mmproj`, arch clip): the
patch embedding's two temporal kernels apart, Qwen2(.5)-VL's q / k / v apart, the tower's
shape as clip.vision.* keys, Qwen2.5-VL's windows as n_wa_pattern, Qwen3-VL's DeepStack
mergers as v.deepstack.LAYER.*, the 2-D tower weights in F16."""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QT
import torch

from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (QWEN_CHAT_TEMPLATE, make_tiny_qwen2_vl, make_tiny_qwen3_5_vl,
                                          make_tiny_qwen3_vl)
from tests.weights.gguf_writer import write_model_gguf, write_tensors

TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
ARCH = {"qwen2_5_vl": "qwen2vl", "qwen2_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe",
        "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
PROJECTOR = {"qwen2_5_vl": "qwen2.5vl_merger", "qwen2_vl": "qwen2vl_merger", "qwen3_vl": "qwen3vl_merger",
             "qwen3_vl_moe": "qwen3vl_merger", "qwen3_5": "qwen3vl_merger", "qwen3_5_moe": "qwen3vl_merger"}
QWEN3_TOWERS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # (Qwen3.5's: Qwen3-VL's, no DeepStack)
# 112-pixel windows, as llama.cpp fixes them: a 224 x 196 image's 8 x 7 merged patches lie in
# 2 x 2 windows, so the windowed layer differs from a full one
WINDOWED = dict(window_size=112, fullatt_block_indexes=[1])
# the released Qwen3-VL preprocessor's limits (64 to 16384 merged 32-pixel patches), which the
# converted folder takes: the tiny checkpoint's processor gets them too
QWEN3_RELEASED_SIZE = {"shortest_edge": 64 * 32 * 32, "longest_edge": 16384 * 32 * 32}
QWEN3_MERGER = {"merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2"}
DEEPSTACK_PARTS = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def _text_model(hf):
    """The language model alone, as the text class the converter's arch stands for."""
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    tc = hf.config.text_config
    common = dict(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                  num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
                  num_key_value_heads=tc.num_key_value_heads, rms_norm_eps=tc.rms_norm_eps,
                  max_position_embeddings=tc.max_position_embeddings, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": tc.rope_parameters["rope_theta"]})
    kind = hf.config.model_type
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3_vl":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=tc.head_dim))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=tc.head_dim, num_experts=tc.num_experts, num_experts_per_tok=tc.num_experts_per_tok,
            moe_intermediate_size=tc.moe_intermediate_size, mlp_only_layers=list(tc.mlp_only_layers),
            norm_topk_prob=True))
    state = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()}
    model.load_state_dict({**state, "lm_head.weight": hf.lm_head.weight})
    return model.eval()


def _qwen35_text_model(hf):
    """Qwen3.5's language model alone, as Qwen3_5(Moe)ForCausalLM."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    cls = Qwen3_5MoeForCausalLM if hf.config.model_type == "qwen3_5_moe" else Qwen3_5ForCausalLM
    model = cls(hf.config.text_config)
    state = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()}
    model.load_state_dict({**state, "lm_head.weight": hf.lm_head.weight})
    return model.eval()


def write_text_gguf(path: Path, hf, tokenizer_json: Path, qtype=QT.F32) -> Path:
    kind = hf.config.model_type
    arch = ARCH[kind]
    if arch.startswith("qwen35"):
        from tests.weights.test_gguf_qwen35 import write_qwen35_gguf

        return write_qwen35_gguf(path, _qwen35_text_model(hf), tokenizer_json, qtype, chat_template=QWEN_CHAT_TEMPLATE)
    sections = list(hf.config.text_config.rope_parameters["mrope_section"])

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_dimension_sections((sections + [0] * 4)[:4])
        if arch != "qwen2vl":
            w.add_uint32(f"{arch}.n_deepstack_layers", len(hf.config.vision_config.deepstack_visual_indexes))

    return write_model_gguf(path, _text_model(hf), tokenizer_json, arch, qtype=qtype, extra_metadata=extra,
                            chat_template=QWEN_CHAT_TEMPLATE)  # (the checkpoint's own, as the converter copies it)


def _keys(w: gguf.GGUFWriter, hf, folder: Path, projector_type: str | None) -> None:
    from transformers import AutoImageProcessor

    vision, kind = hf.config.vision_config, hf.config.model_type
    images = AutoImageProcessor.from_pretrained(str(folder))
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector_type or PROJECTOR[kind])
    w.add_vision_projection_dim(hf.config.text_config.hidden_size)
    w.add_vision_patch_size(vision.patch_size)
    w.add_vision_block_count(vision.depth)
    w.add_vision_head_count(vision.num_heads)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean(list(images.image_mean))
    w.add_vision_image_std(list(images.image_std))
    if kind in QWEN3_TOWERS:
        w.add_vision_image_size(int(vision.num_position_embeddings ** 0.5) * vision.patch_size)
        w.add_vision_embedding_length(vision.hidden_size)
        w.add_vision_feed_forward_length(vision.intermediate_size)
        w.add_vision_use_gelu(True)
        w.add_vision_spatial_merge_size(vision.spatial_merge_size)
        deepstack = getattr(vision, "deepstack_visual_indexes", [])
        w.add_vision_is_deepstack_layers([i in deepstack for i in range(vision.depth)])
        return
    w.add_vision_image_size(560)  # the converter's default (the config has none)
    v25 = kind == "qwen2_5_vl"
    w.add_vision_embedding_length(vision.hidden_size if v25 else vision.embed_dim)
    # Qwen2-VL's: the merger's width, as the converter reads "hidden_size"
    w.add_vision_feed_forward_length(vision.intermediate_size if v25 else vision.hidden_size)
    if v25:
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(vision.fullatt_block_indexes[0] + 1)


def _tensor_name(name: str, hf, table: gguf.TensorNameMap) -> str:
    """The converter's name for one of the tower's tensors (`name` without "visual.")."""
    if name.startswith("merger.mlp."):  # Qwen2(.5)-VL's merger: named by the converter itself
        return name.replace("merger.mlp.", "mm.")
    stem, _, kind = name.rpartition(".")
    if stem in QWEN3_MERGER:
        return f"{QWEN3_MERGER[stem]}.{kind}"
    if name.startswith("deepstack_merger_list."):  # v.deepstack.<the tower layer it reads>.*
        _, index, part, kind = name.split(".")
        layer = hf.config.vision_config.deepstack_visual_indexes[int(index)]
        return f"v.deepstack.{layer}.{DEEPSTACK_PARTS[part]}.{kind}"
    return table.get_name(f"visual.{name}", try_suffixes=(".weight", ".bias"))


def write_qwen_mmproj(path: Path, hf, folder: Path, projector_type: str | None = None) -> Path:
    vision, kind = hf.config.vision_config, hf.config.model_type
    w = gguf.GGUFWriter(str(path), "clip")
    _keys(w, hf, folder, projector_type)
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    tensors = []
    for name, tensor in hf.model.visual.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if name == "patch_embed.proj.weight":  # Conv3d [C, 3, 2, p, p]: its temporal kernels apart
            tensors += [("v.patch_embd.weight", array[:, :, 0].copy(), QT.F16),
                        ("v.patch_embd.weight.1", array[:, :, 1].copy(), QT.F16)]
            continue
        if ".attn.qkv." in name and kind in ("qwen2_vl", "qwen2_5_vl"):
            third = array.shape[0] // 3
            block, part = name.split(".")[1], name.rsplit(".", 1)[1]
            tensors += [(f"v.blk.{block}.attn_{p}.{part}", array[i * third:(i + 1) * third].copy(), QT.F16 if
                         array.ndim == 2 else QT.F32) for i, p in enumerate("qkv")]
            continue
        stored = QT.F16 if array.ndim == 2 and name != "pos_embed.weight" else QT.F32
        tensors.append((_tensor_name(name, hf, table), array, stored))
    write_tensors(w, tensors)
    return path


def _sharpened_and_half_rounded(hf) -> None:
    """Queries and keys 20 times larger, so that the tower's attention is far from uniform
    (at the random init's scale, windows or q and k swapped change the logprobs by < 1e-4);
    then the tower weights as the projector file holds them (2-D ones and the patch kernels
    in F16, the position table in F32)."""
    with torch.no_grad():
        for block in hf.model.visual.blocks:
            block.attn.qkv.weight.mul_(20.0)
        for name, p in hf.model.visual.named_parameters():
            if (p.ndim == 2 and name != "pos_embed.weight") or name == "patch_embed.proj.weight":
                p.copy_(p.half().float())


def make_qwen_vl_files(kind: str, folder: Path, files: Path):
    """(the tiny Hugging Face model in `folder`, its text GGUF, its projector file)."""
    from transformers import AutoImageProcessor

    if kind in ("qwen2_vl", "qwen2_5_vl"):
        hf = make_tiny_qwen2_vl(folder, TINY_CORPUS, model_type=kind, seed=3,
                                vision_overrides=WINDOWED if kind == "qwen2_5_vl" else None)
    else:
        make = make_tiny_qwen3_vl if kind.startswith("qwen3_vl") else make_tiny_qwen3_5_vl
        hf = make(folder, TINY_CORPUS, seed=3, moe=kind.endswith("_moe"))
        processor = AutoImageProcessor.from_pretrained(str(folder))
        processor.size = dict(QWEN3_RELEASED_SIZE)
        processor.save_pretrained(str(folder))
    _sharpened_and_half_rounded(hf)
    return (hf, write_text_gguf(files / "model.gguf", hf, folder / "tokenizer.json"),
            write_qwen_mmproj(files / "mmproj-model.gguf", hf, folder))
