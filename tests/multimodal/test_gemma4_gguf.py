"""Gemma 4 from llama.cpp's files: the language model's GGUF (arch gemma4) with the projector
file beside it (`--mmproj`, clip projector type "gemma4v", written as convert_hf_to_gguf.py
writes it: gguf's TensorNameMap names after the converter's renaming, the patch embedding as
a convolution, the clipped linears' bounds as 1-element tensors, no pooling or token budget
keys). Against transformers' model the files were written from, with the released
processor's settings (280 soft tokens pooled 3 x 3): the same prompt tokens, greedy tokens,
logprobs and vision weights; E2B's layout (per-layer embeddings: causal image tokens) and the
larger releases' (image tokens seeing each other)."""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QT
import pytest
import torch

from tessera import LLM
from tessera.weights.gguf_mmproj import MmprojError
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import random_image
from tests.multimodal.gemma4_checkpoint import GEMMA4_IMAGE, hf_gemma4_generate, make_tiny_gemma4
from tests.multimodal.image_checks import assert_vision_weights_equal, check_image_prompt
from tests.multimodal.test_gemma4 import hf_logprobs
from tests.weights.gguf_gemma4 import write_gemma4_gguf
from tests.weights.gguf_writer import clip_writer, write_model_gguf, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

N = 10
PROMPT = f"The quick {GEMMA4_IMAGE} brown fox"
CLAMPS = (".input_max", ".input_min", ".output_max", ".output_min")


def write_text_gguf(path: Path, hf, tokenizer_json: Path) -> Path:
    from transformers import Gemma4ForCausalLM

    text = Gemma4ForCausalLM(hf.config.text_config).eval()
    state = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()}
    text.load_state_dict({**state, "lm_head.weight": hf.lm_head.weight})
    return write_gemma4_gguf(path, text, tokenizer_json, add_bos=True)  # (as Gemma's files say)


def converter_name(hf_name: str) -> str:
    """The name convert_hf_to_gguf.py's Gemma4VisionAudioModel hands gguf's TensorNameMap
    (written out here apart from tessera's reader, which inverts it)."""
    name = hf_name.replace("model.vision_tower.encoder.", "vision_model.model.")
    name = name.replace(".linear.weight", ".weight")
    return name + ".weight" if name.endswith(("layer_scalar", "position_embedding_table")) else name


def write_gemma4_mmproj(path: Path, hf) -> Path:
    """The vision tower and embedder as convert_hf_to_gguf.py --mmproj writes Gemma 4's."""
    vision = hf.config.vision_config
    w = clip_writer(path, "gemma4v", image_size=224, patch_size=vision.patch_size, width=vision.hidden_size,
                    ffn=vision.intermediate_size, blocks=vision.num_hidden_layers, heads=vision.num_attention_heads,
                    eps=vision.rms_norm_eps, projection=hf.config.text_config.hidden_size, vision_projector_key=True)
    w.add_vision_image_mean([0.0, 0.0, 0.0])
    w.add_vision_image_std([1.0, 1.0, 1.0])
    table = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    tensors = []
    for name, tensor in hf.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        array = tensor.detach().float().numpy().copy()
        if array.ndim == 0:
            array = array.reshape(1)
        if name.endswith("patch_embedder.input_proj.weight"):  # the linear as a convolution
            p = vision.patch_size
            array = array.reshape(array.shape[0], p, p, 3).transpose(0, 3, 1, 2).copy()
        gguf_name = table.get_name(converter_name(name), try_suffixes=(".weight", ".bias", *CLAMPS))
        assert gguf_name is not None, name
        stored = QT.F32 if array.ndim < 2 or "position_embd" in gguf_name else QT.F16
        tensors.append((gguf_name, array, stored))
    write_tensors(w, tensors)
    return path


@pytest.fixture(scope="module", params=["e2b", "moe"])
def gemma4_files(request, tmp_path_factory):
    case = request.param
    folder = tmp_path_factory.mktemp(f"gemma4-{case}-hf")
    hf = make_tiny_gemma4(folder, TINY_CORPUS, seed=5, bidirectional=case == "moe", text_case=case, pooling=3,
                          max_soft_tokens=280, clipped=True)
    with torch.no_grad():  # the 2-D tower weights as the file's F16 copies hold them
        for name, p in hf.named_parameters():
            if name.startswith(("model.vision_tower.", "model.embed_vision.")) and p.ndim >= 2 \
                    and "position_embedding_table" not in name:
                p.copy_(p.half().float())
    files = tmp_path_factory.mktemp(f"gemma4-{case}-gguf")
    return (folder, hf, write_text_gguf(files / "gemma4.gguf", hf, folder / "tokenizer.json"),
            write_gemma4_mmproj(files / "mmproj-gemma4.gguf", hf))


def test_the_gguf_and_its_mmproj_equal_transformers(gemma4_files, tmp_path):
    folder, hf, text, mmproj = gemma4_files
    images = [random_image(1, size=(60, 40))]
    prompt, want = hf_gemma4_generate(hf, folder, PROMPT, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        router = llm.engine.router
        assert llm.engine.supports_images and router.full_config.model_type == "gemma4"
        assert router.bidirectional_image_attention == (hf.config.text_config.use_bidirectional_attention == "vision")
        check_image_prompt(llm, PROMPT, images, prompt, want,
                           lambda got: hf_logprobs(hf, folder, PROMPT, images, got), N)
        assert_vision_weights_equal(llm, hf)
        tower = llm.engine.model.vision.hf.vision_tower
        assert float(tower.encoder.layers[0].self_attn.q_proj.input_max) == 0.5  # a bound that clips, loaded


def test_refusals(gemma4_files, tmp_path):
    folder, hf, text, mmproj = gemma4_files
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=hf.config.text_config.vocab_size, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    llama_gguf = write_model_gguf(tmp_path / "llama.gguf", llama, folder / "tokenizer.json", "llama")
    with pytest.raises(MmprojError, match="goes with a Gemma 4 GGUF, not a llama one"):
        LLM(llama_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
