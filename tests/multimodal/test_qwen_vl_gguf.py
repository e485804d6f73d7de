"""Qwen2.5-VL and Qwen2-VL from llama.cpp's files: the language model's GGUF (arch qwen2vl,
with its M-RoPE sections) and the projector file beside it (`--mmproj`, clip projector type
qwen2.5vl_merger / qwen2vl_merger, written as convert_hf_to_gguf.py writes them: the patch
embedding's two temporal kernels and each block's q / k / v apart, the tower's shape as
clip.vision.* keys, Qwen2.5-VL's windows as n_wa_pattern). Against transformers' model the
files were written from: the same prompt tokens, greedy tokens and logprobs with images."""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QT
import pytest
import torch

from tessera import LLM
from tessera.weights.gguf_mmproj import MmprojError
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (QWEN_IMAGE, check_image_prompt, greedy, hf_qwen_generate, hf_qwen_logprobs, image_prompt,
                                          make_tiny_qwen2_vl, random_image)
from tests.weights.gguf_writer import write_model_gguf, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12
TWO_IMAGES = f"The quick {QWEN_IMAGE} brown fox {QWEN_IMAGE} jumps"
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# 112-pixel windows, as llama.cpp fixes them: a 224 x 196 image's 8 x 7 merged patches lie in
# 2 x 2 windows, so the windowed layer differs from a full one
WINDOWED = dict(window_size=112, fullatt_block_indexes=[1])


def write_text_gguf(path: Path, hf, tokenizer_json: Path, qtype=QT.F32) -> Path:
    """The language model as llama.cpp's converter writes Qwen2(.5)-VL's (arch qwen2vl)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tc = hf.config.text_config
    config = Qwen2Config(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                         num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
                         num_key_value_heads=tc.num_key_value_heads, rms_norm_eps=tc.rms_norm_eps,
                         max_position_embeddings=tc.max_position_embeddings, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": tc.rope_parameters["rope_theta"]})
    text = Qwen2ForCausalLM(config).eval()
    state = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()}
    text.load_state_dict({**state, "lm_head.weight": hf.lm_head.weight})
    sections = list(tc.rope_parameters["mrope_section"])
    return write_model_gguf(path, text, tokenizer_json, "qwen2vl", qtype=qtype,
                            extra_metadata=lambda w: w.add_rope_dimension_sections((sections + [0] * 4)[:4]))


def write_qwen_mmproj(path: Path, hf, projector_type: str | None = None) -> Path:
    """The vision tower and merger as convert_hf_to_gguf.py --mmproj writes Qwen2(.5)-VL's."""
    vision, model_type = hf.config.vision_config, hf.config.model_type
    v25 = model_type == "qwen2_5_vl"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector_type or ("qwen2.5vl_merger" if v25 else "qwen2vl_merger"))
    w.add_vision_projection_dim(hf.config.text_config.hidden_size)
    w.add_vision_image_size(560)  # the converter's default (the config has none)
    w.add_vision_patch_size(vision.patch_size)
    w.add_vision_embedding_length(vision.hidden_size if v25 else vision.embed_dim)
    # Qwen2-VL's: the merger's width, as the converter reads "hidden_size"
    w.add_vision_feed_forward_length(vision.intermediate_size if v25 else vision.hidden_size)
    w.add_vision_block_count(vision.depth)
    w.add_vision_head_count(vision.num_heads)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean(CLIP_MEAN)
    w.add_vision_image_std(CLIP_STD)
    if v25:
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(vision.fullatt_block_indexes[0] + 1)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    tensors = []
    for name, tensor in hf.model.visual.state_dict().items():
        name, array = f"visual.{name}", tensor.detach().float().numpy().copy()
        if name == "visual.patch_embed.proj.weight":  # Conv3d [C, 3, 2, p, p]: its temporal kernels apart
            tensors += [("v.patch_embd.weight", array[:, :, 0].copy(), QT.F32),
                        ("v.patch_embd.weight.1", array[:, :, 1].copy(), QT.F32)]
            continue
        if ".attn.qkv." in name:
            third = array.shape[0] // 3
            block, kind = name.split(".")[2], name.rsplit(".", 1)[1]
            tensors += [(f"v.blk.{block}.attn_{part}.{kind}", array[i * third:(i + 1) * third].copy(), QT.F32)
                        for i, part in enumerate("qkv")]
            continue
        stored = QT.F16 if array.ndim == 2 else QT.F32
        if name.startswith("visual.merger.mlp."):  # (the converter names the merger's two linears itself)
            tensors.append((name.replace("visual.merger.mlp.", "mm."), array, stored))
            continue
        tensors.append((names.get_name(name, try_suffixes=(".weight", ".bias")), array, stored))
    write_tensors(w, tensors)
    return path


def sharpened_and_half_rounded(hf) -> None:
    """Queries and keys 20 times larger, so that the tower's attention is far from uniform
    (at the random init's scale, windows or q and k swapped change the logprobs by < 1e-4);
    then the 2-D tower weights as their F16 copies in the projector file hold them."""
    with torch.no_grad():
        for block in hf.model.visual.blocks:
            block.attn.qkv.weight.mul_(20.0)
        for name, p in hf.model.visual.named_parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def qwen_files(request, tmp_path_factory):
    model_type = request.param
    folder = tmp_path_factory.mktemp(f"{model_type}-hf")
    hf = make_tiny_qwen2_vl(folder, TINY_CORPUS, model_type=model_type, seed=3,
                            vision_overrides=WINDOWED if model_type == "qwen2_5_vl" else None)
    sharpened_and_half_rounded(hf)
    files = tmp_path_factory.mktemp(f"{model_type}-gguf")
    return (folder, hf, write_text_gguf(files / "model.gguf", hf, folder / "tokenizer.json"),
            write_qwen_mmproj(files / "mmproj-model.gguf", hf))


def test_the_gguf_and_its_mmproj_equal_transformers(qwen_files, tmp_path):
    folder, hf, text, mmproj = qwen_files
    images = [random_image(1, size=(224, 196)), random_image(2, size=(64, 90))]
    prompt, want = hf_qwen_generate(hf, folder, TWO_IMAGES, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        assert llm.engine.supports_images and llm.engine.router.full_config.model_type == hf.config.model_type
        text_only = check_image_prompt(llm, TWO_IMAGES, images, prompt, want,
                                       lambda got: hf_qwen_logprobs(hf, folder, TWO_IMAGES, images, got), N)
    _, plain = hf_qwen_generate(hf, folder, "Paged attention stores", [], N)
    assert text_only.outputs[0].token_ids == plain


def test_the_gguf_alone_is_its_text_model(qwen_files, tmp_path):
    """Without a projector the file is a Qwen2 for text (M-RoPE over text is plain rotary)."""
    folder, hf, text, _ = qwen_files
    with LLM(text, dtype="float32", num_kv_blocks=16, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        assert not llm.engine.supports_images and llm.engine.router.config.model_type == "qwen2"
        out = llm.generate("The quick brown fox", greedy(N), use_tqdm=False)[0]
    _, want = hf_qwen_generate(hf, folder, "The quick brown fox", [], N)
    assert out.outputs[0].token_ids == want


def test_the_files_give_back_the_checkpoints_config(qwen_files, tmp_path):
    """What the tower runs with: the converted folder's vision config is the original's
    (Qwen2.5-VL's windows from n_wa_pattern and llama.cpp's 112 pixels; Qwen2-VL's MLP ratio
    from its tensors), and so are the M-RoPE sections and the vision tokens."""
    folder, hf, text, mmproj = qwen_files
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=16, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.full_config
    want, got = hf.config.vision_config.to_dict(), config.vision_config.to_dict()
    fields = type(hf.config.vision_config)().to_dict()  # (the class's own: the tiny config carries strays)
    keys = [k for k in fields if k not in ("initializer_range", "tokens_per_second", "transformers_version", "dtype")]
    assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys}
    assert config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(config, name) == getattr(hf.config, name)


def test_the_windows_matter(qwen_files):
    """Full attention in every layer of the tower gives the prompt other logprobs: the
    match above holds for the windows read from the file (n_wa_pattern, 112 pixels)."""
    folder, hf, _, _ = qwen_files
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2-VL's tower has no windows")
    images, prompt = [random_image(1, size=(224, 196))], f"A {QWEN_IMAGE} of"
    _, tokens = hf_qwen_generate(hf, folder, prompt, images, 4)
    windowed = hf_qwen_logprobs(hf, folder, prompt, images, tokens)
    visual = hf.model.visual
    visual.fullatt_block_indexes = [0, 1]
    try:
        full = hf_qwen_logprobs(hf, folder, prompt, images, tokens)
    finally:
        visual.fullatt_block_indexes = WINDOWED["fullatt_block_indexes"]
    assert max(abs(a - b) for a, b in zip(windowed, full)) > 1e-3


def test_refusals(qwen_files, tmp_path):
    folder, hf, text, mmproj = qwen_files
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    llama_gguf = write_model_gguf(tmp_path / "llama.gguf", llama, folder / "tokenizer.json", "llama")
    with pytest.raises(MmprojError, match="goes with a Qwen2-VL / Qwen2.5-VL GGUF .arch qwen2vl., not a llama one"):
        LLM(llama_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")


def test_two_ranks_give_one_ranks_tokens(qwen_files, tmp_path):
    """Each rank reads its slices of the text GGUF, the driver alone the projector file."""
    folder, hf, text, mmproj = qwen_files
    images, prompt = [random_image(3, size=(112, 84))], f"A {QWEN_IMAGE} of"
    _, want = hf_qwen_generate(hf, folder, prompt, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache", tensor_parallel_size=2) as llm:
        out = llm.generate(image_prompt(prompt, images), greedy(N), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
