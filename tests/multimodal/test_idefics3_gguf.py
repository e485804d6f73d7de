"""SmolVLM / Idefics3 from llama.cpp's files: the language model's GGUF (arch "llama", Q and K
permuted) with the projector file beside it (`--mmproj`, clip projector type "idefics3",
written as convert_hf_to_gguf.py --mmproj writes it: gguf's own tensor names, embeddings in
F32, the other matrices in F16, the tower's shape, the connector's scale factor and the
preprocessor's longest edge as clip.vision.* keys). Against transformers' model the files
were written from: the same prompt tokens (tiles, whole views and their markers), greedy
tokens and logprobs."""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as QT
import pytest
import torch

from tessera import LLM
from tessera.weights.gguf_mmproj import MmprojError
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import (greedy, hf_image_generate, hf_image_logprobs, image_prompt,
                                          make_tiny_idefics3, random_image)
from tests.multimodal.image_checks import assert_vision_weights_equal, check_image_prompt
from tests.weights.gguf_writer import clip_writer, write_model_gguf, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12
TEXT = "The quick <image> brown fox <image> jumps"
# make_tiny_idefics3's processor: longest edge 112 pixels, 56-pixel tiles
SIZES = [(100, 40), (40, 40)]
VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
               "patch_size", "layer_norm_eps", "hidden_act")


def write_text_gguf(path: Path, hf, tokenizer_json: Path) -> Path:
    """The language model as llama.cpp's converter writes SmolVLM's (arch llama)."""
    from transformers import LlamaForCausalLM

    text = LlamaForCausalLM(hf.config.text_config).eval()
    state = {f"model.{k}": v for k, v in hf.model.text_model.state_dict().items()}
    text.load_state_dict({**state, "lm_head.weight": hf.lm_head.weight})
    return write_model_gguf(path, text, tokenizer_json, "llama")


def write_idefics3_mmproj(path: Path, hf, folder: Path, *, scale_key: bool = True, longest_edge: bool = True) -> Path:
    """The tower and connector as convert_hf_to_gguf.py --mmproj writes SmolVLM's."""
    from transformers import AutoImageProcessor

    vision = hf.config.vision_config
    images = AutoImageProcessor.from_pretrained(str(folder))
    w = clip_writer(path, "idefics3", image_size=vision.image_size, patch_size=vision.patch_size,
                    width=vision.hidden_size, ffn=vision.intermediate_size, blocks=vision.num_hidden_layers,
                    heads=vision.num_attention_heads, eps=vision.layer_norm_eps,
                    projection=hf.config.text_config.hidden_size)
    w.add_vision_image_mean(list(images.image_mean))
    w.add_vision_image_std(list(images.image_std))
    w.add_vision_use_gelu(True)
    if scale_key:
        w.add_vision_projector_scale_factor(hf.config.scale_factor)
    if longest_edge:
        w.add_vision_preproc_image_size(images.size["longest_edge"])
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    tensors = []
    for name, tensor in hf.model.state_dict().items():
        if not name.startswith(("vision_model.", "connector.")) or name.endswith("position_ids"):
            continue
        array = tensor.detach().float().numpy().copy()
        stored = QT.F16 if array.ndim >= 2 and ".embeddings." not in name else QT.F32
        tensors.append((names.get_name("model." + name, try_suffixes=(".weight", ".bias")), array, stored))
    write_tensors(w, tensors)
    return path


@pytest.fixture(scope="module")
def idefics3_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("idefics3-hf")
    hf = make_tiny_idefics3(folder, TINY_CORPUS, seed=5)
    with torch.no_grad():  # the tower's and connector's matrices as the file's F16 copies hold them
        for name, p in hf.model.named_parameters():
            if name.startswith(("vision_model.", "connector.")) and p.ndim >= 2 and ".embeddings." not in name:
                p.copy_(p.half().float())
    files = tmp_path_factory.mktemp("idefics3-gguf")
    return (folder, hf, write_text_gguf(files / "smolvlm.gguf", hf, folder / "tokenizer.json"),
            write_idefics3_mmproj(files / "mmproj-smolvlm.gguf", hf, folder))


def test_the_gguf_and_its_mmproj_equal_transformers(idefics3_files, tmp_path):
    folder, hf, text, mmproj = idefics3_files
    images = [random_image(1, size=SIZES[0]), random_image(2, size=SIZES[1])]
    prompt, want = hf_image_generate(hf, folder, TEXT, images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        config = llm.engine.router.full_config
        assert llm.engine.supports_images and config.model_type == "idefics3"
        assert config.scale_factor == hf.config.scale_factor
        for key in VISION_KEYS:  # (at the random init's scale, GELU's exact form barely moves a token)
            theirs = getattr(hf.config.vision_config, key)
            assert getattr(config.vision_config, key) == (pytest.approx(theirs) if key.endswith("eps") else theirs), key
        ids, _ = llm.engine.process_images(TEXT, images)
        assert ids.count(hf.config.image_token_id) > 2 * 4  # the wide image's tiles, and both whole views
        text_only = check_image_prompt(llm, TEXT, images, prompt, want,
                                       lambda got: hf_image_logprobs(hf, folder, TEXT, images, got), N)
        assert_vision_weights_equal(llm, hf)
    ids = torch.tensor([text_only.prompt_token_ids])
    with torch.no_grad():
        plain = hf.generate(input_ids=ids, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert text_only.outputs[0].token_ids == plain[0, ids.shape[1]:].tolist()


def test_without_a_longest_edge_an_image_is_one_tile(idefics3_files, tmp_path):
    """A file without preproc_image_size: every image is resized into one tile (no split),
    as a processor whose longest edge is the tile's size does."""
    folder, hf, text, _ = idefics3_files
    mmproj = write_idefics3_mmproj(tmp_path / "mmproj-one-tile.gguf", hf, folder, longest_edge=False)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        counts = [llm.engine.process_images("<image>", [random_image(seed, size=size)], False)[0]
                  .count(hf.config.image_token_id) for seed, size in enumerate(SIZES)]
    assert counts == [4, 4]  # 56 / 14 = 4 x 4 patches, shuffled by 2: 4 tokens, the whole view only


def test_two_ranks_give_one_ranks_tokens(idefics3_files, tmp_path):
    folder, hf, text, mmproj = idefics3_files
    images = [random_image(3, size=SIZES[0])]
    _, want = hf_image_generate(hf, folder, "A <image> of", images, N)
    with LLM(text, mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache", tensor_parallel_size=2) as llm:
        out = llm.generate(image_prompt("A <image> of", images), greedy(N), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want


def test_refusals(idefics3_files, tmp_path):
    folder, hf, text, mmproj = idefics3_files
    no_scale = write_idefics3_mmproj(tmp_path / "no-scale.gguf", hf, folder, scale_key=False)
    with pytest.raises(MmprojError, match="lacks clip.vision.projector.scale_factor"):
        LLM(text, mmproj=no_scale, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    qwen_gguf = write_model_gguf(tmp_path / "qwen2.gguf", qwen, folder / "tokenizer.json", "qwen2")
    with pytest.raises(MmprojError, match="goes with the GGUF of a SmolVLM or Idefics3 model"):
        LLM(qwen_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    from tests.multimodal.checkpoints import TEXT_CONFIG, bpe_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    plain_folder = tmp_path / "plain-tokenizer"
    bpe_tokenizer(TINY_CORPUS, []).save_pretrained(str(plain_folder))
    llama = LlamaForCausalLM(LlamaConfig(**TEXT_CONFIG))
    llama_gguf = write_model_gguf(tmp_path / "llama.gguf", llama, plain_folder / "tokenizer.json", "llama")
    with pytest.raises(MmprojError, match="lacks Idefics3's image tokens"):
        LLM(llama_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
