"""Gemma 3 from llama.cpp's files: the language model's GGUF with its multimodal projector
beside it (`--mmproj`, a GGUF of arch "clip" as convert_hf_to_gguf.py --mmproj writes it:
gguf's own tensor names, the soft-embedding norm stored as 1 + w, the tower's shape and the
image processor's settings as clip.vision.* keys). Against transformers' model the files
were written from: the same prompt tokens and greedy tokens with images."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
import pytest
import torch

from tessera import LLM
from tessera.weights.gguf_mmproj import MmprojError
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (GEMMA3_IMAGE, greedy, hf_image_generate, hf_image_logprobs, image_prompt,
                                          make_tiny_gemma3, random_image)
from tests.multimodal.image_checks import assert_vision_weights_equal, check_image_prompt
from tests.weights.gguf_writer import clip_writer, write_model_gguf, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12
TWO_IMAGES = f"The quick {GEMMA3_IMAGE} brown fox {GEMMA3_IMAGE} jumps"


def write_text_gguf(path: Path, hf, tokenizer_json: Path, qtype=QT.F32) -> Path:
    """The language model as llama.cpp's converter writes Gemma 3's (arch gemma3)."""
    from transformers import Gemma3ForCausalLM

    text = Gemma3ForCausalLM(hf.config.text_config).eval()
    state = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()}
    text.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    return write_model_gguf(path, text, tokenizer_json, "gemma3", qtype=qtype, add_bos=True)


def write_gemma3_mmproj(path: Path, hf, projector_type: str = "gemma3") -> Path:
    """The vision tower and projector as convert_hf_to_gguf.py --mmproj writes Gemma 3's."""
    vision, text = hf.config.vision_config, hf.config.text_config
    w = clip_writer(path, projector_type, image_size=vision.image_size, patch_size=vision.patch_size,
                    width=vision.hidden_size, ffn=vision.intermediate_size, blocks=vision.num_hidden_layers,
                    heads=vision.num_attention_heads, eps=vision.layer_norm_eps, projection=text.hidden_size,
                    vision_projector_key=True)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    side = (vision.image_size // vision.patch_size) // int(hf.config.mm_tokens_per_image ** 0.5)
    w.add_vision_projector_scale_factor(side)  # (written only where it is not 4)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    tensors = []
    for name, tensor in hf.model.state_dict().items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or name.endswith("position_ids") \
                or ".head." in name:  # (SigLIP's pooling head, which Gemma 3 never runs: the converter skips it)
            continue
        if not name.startswith(("vision_tower.vision_model.", "multi_modal_projector.")):  # as released
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        converted = name.replace("_weight", ".weight")
        array = tensor.detach().float().numpy().copy()
        if "soft_emb_norm" in name:
            array = array + np.float32(1.0)
        stored = QT.F16 if "input_projection" in name else QT.F32  # F16, as llama.cpp forces it
        tensors.append((names.get_name(converted, try_suffixes=(".weight", ".bias")), array, stored))
    write_tensors(w, tensors)
    return path


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-hf")
    # the file has no query_pre_attn_scalar (llama.cpp scales queries by head_dim's) and no
    # layer types (llama.cpp's pattern: every sixth layer global)
    hf = make_tiny_gemma3(folder, TINY_CORPUS, text_overrides={
        "query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    with torch.no_grad():  # (make_tiny_gemma3 draws it, so that images matter) as its F16 copy holds it
        projection = hf.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_(projection.half().float())
    files = tmp_path_factory.mktemp("gemma3-gguf")
    return (folder, hf, write_text_gguf(files / "gemma3.gguf", hf, folder / "tokenizer.json"),
            write_gemma3_mmproj(files / "mmproj-gemma3.gguf", hf))


def test_the_gguf_and_its_mmproj_equal_transformers(gemma3_files, tmp_path):
    folder, hf, text, mmproj = gemma3_files
    images = [random_image(1), random_image(2, size=(64, 30))]
    prompt, want = hf_image_generate(hf, folder, TWO_IMAGES, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        assert llm.engine.supports_images and llm.engine.router.config.model_type == "gemma3_text"
        text_only = check_image_prompt(llm, TWO_IMAGES, images, prompt, want,
                                       lambda got: hf_image_logprobs(hf, folder, TWO_IMAGES, images, got), N)
        assert_vision_weights_equal(llm, hf)
    ids = torch.tensor([text_only.prompt_token_ids])
    with torch.no_grad():
        plain = hf.generate(input_ids=ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    assert text_only.outputs[0].token_ids == plain[0, ids.shape[1]:].tolist()


def test_refusals(gemma3_files, tmp_path):
    folder, hf, text, mmproj = gemma3_files
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF"):
        LLM(folder, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    with pytest.raises(MmprojError, match="not a multimodal projector"):
        LLM(text, mmproj=text, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    other = write_gemma3_mmproj(tmp_path / "llava.gguf", hf, projector_type="mlp")
    with pytest.raises(MmprojError, match="projector type 'mlp' is not read"):
        LLM(text, mmproj=other, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    llama_gguf = write_model_gguf(tmp_path / "llama.gguf", llama, folder / "tokenizer.json", "llama")
    with pytest.raises(MmprojError, match="goes with a Gemma 3 GGUF, not a llama one"):
        LLM(llama_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    with LLM(text, dtype="float32", num_kv_blocks=16, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        assert not llm.engine.supports_images  # the GGUF alone: its text model


def test_two_ranks_give_one_ranks_tokens(gemma3_files, tmp_path):
    """Under tensor parallelism each rank reads its slices of the text GGUF and the driver
    alone the projector file (it alone encodes): transformers' tokens with images."""
    folder, hf, text, mmproj = gemma3_files
    images = [random_image(3)]
    _, want = hf_image_generate(hf, folder, f"A {GEMMA3_IMAGE} of", images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache", tensor_parallel_size=2) as llm:
        out = llm.generate(image_prompt(f"A {GEMMA3_IMAGE} of", images), greedy(N), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
