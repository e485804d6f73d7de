"""Mistral Small 3.1 / 3.2 from llama.cpp's files: the language model's GGUF (arch "llama", as
older files have it, or "mistral3", the newer converter's; Q and K permuted) with the
projector file beside it (`--mmproj`, clip projector type "pixtral", written as
convert_hf_to_gguf.py writes it: the tower's Q and K permuted as Llama's, the [IMG_BREAK]
embedding row copied out, the tower's shape and the processor's longest edge as
clip.vision.* keys). Against transformers' model the files were written from: the same
prompt tokens, greedy tokens and logprobs with images of their own shapes."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from gguf import GGMLQuantizationType as QT
import pytest
import torch

from tessera import LLM
from tessera.weights.gguf_mmproj import MmprojError
from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import greedy, image_prompt, make_tiny_mistral3, random_image
from tests.multimodal.image_checks import assert_vision_weights_equal, check_image_prompt
from tests.weights.gguf_writer import clip_writer, llama_cpp_permute, write_model_gguf, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12
TEXT = "The quick [IMG] brown fox [IMG] jumps"
# images up to 224 pixels long: up to 16 rows of 16 tokens
IMAGE_SIZE = 224
SIZES = [(200, 120), (150, 150)]
GLOBAL = {"vision_tower.patch_conv": "v.patch_embd", "vision_tower.ln_pre": "v.pre_ln",
          "multi_modal_projector.norm": "mm.input_norm",
          "multi_modal_projector.patch_merger.merging_layer": "mm.patch_merger",
          "multi_modal_projector.linear_1": "mm.1", "multi_modal_projector.linear_2": "mm.2"}
BLOCK = {"attention.q_proj": "attn_q", "attention.k_proj": "attn_k", "attention.v_proj": "attn_v",
         "attention.o_proj": "attn_out", "attention_norm": "ln1", "ffn_norm": "ln2",
         "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down"}


def write_text_gguf(path: Path, hf, tokenizer_json: Path, arch: str) -> Path:
    """The language model as llama.cpp's converter writes Mistral 3's (Q and K permuted)."""
    from transformers import MistralForCausalLM

    text = MistralForCausalLM(hf.config.text_config).eval()
    state = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()}
    text.load_state_dict({**state, "lm_head.weight": hf.lm_head.weight})
    return write_model_gguf(path, text, tokenizer_json, arch)


def write_pixtral_mmproj(path: Path, hf, folder: Path, merger: bool = True) -> Path:
    """The tower and projector as convert_hf_to_gguf.py --mmproj writes Mistral 3's."""
    from transformers import AutoImageProcessor, AutoTokenizer

    vision = hf.config.vision_config
    images = AutoImageProcessor.from_pretrained(str(folder))
    w = clip_writer(path, "pixtral", image_size=vision.image_size, patch_size=vision.patch_size,
                    width=vision.hidden_size, ffn=vision.intermediate_size, blocks=vision.num_hidden_layers,
                    heads=vision.num_attention_heads, eps=1e-5, projection=hf.config.text_config.hidden_size)
    w.add_vision_image_mean(list(images.image_mean))
    w.add_vision_image_std(list(images.image_std))
    (w.add_vision_use_silu if vision.hidden_act == "silu" else w.add_vision_use_gelu)(True)
    w.add_vision_spatial_merge_size(hf.config.spatial_merge_size)
    tensors = []
    for name, tensor in hf.model.state_dict().items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        array = tensor.detach().float().numpy().copy()
        stem, _, kind = name.rpartition(".")
        if stem in GLOBAL:
            if "patch_merger" in stem and not merger:
                continue
            tensors.append((f"{GLOBAL[stem]}.{kind}", array, QT.F16 if array.ndim >= 2 else QT.F32))
            continue
        layer, part = stem.removeprefix("vision_tower.transformer.layers.").split(".", 1)
        if part in ("attention.q_proj", "attention.k_proj"):
            array = llama_cpp_permute(array, vision.num_attention_heads)
        tensors.append((f"v.blk.{layer}.{BLOCK[part]}.{kind}", array, QT.F16 if array.ndim == 2 else QT.F32))
    img_break = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("[IMG_BREAK]")
    row = hf.model.language_model.embed_tokens.weight[img_break].detach().float().numpy().copy()
    tensors.append(("v.token_embd.img_break", row, QT.F32))
    write_tensors(w, tensors)
    return path


def half_rounded(hf) -> None:
    """The tower's and projector's 2-D weights as the file's F16 copies hold them. (At the
    random init's scale the tower's attention barely moves the logprobs: a wrong Q / K row
    order shows in assert_vision_weights_equal, not in the tokens.)"""
    with torch.no_grad():
        for name, p in hf.model.named_parameters():
            if name.startswith(("vision_tower.", "multi_modal_projector.")) and p.ndim >= 2:
                p.copy_(p.half().float())


def hf_reference(hf, folder: Path, images: list, n: int) -> tuple[list[int], list[int], Callable]:
    """transformers' prompt ids, greedy tokens and a logprob function for TEXT with `images`."""
    from transformers import AutoImageProcessor, AutoTokenizer

    pixels = AutoImageProcessor.from_pretrained(str(folder))(images=images, patch_size=14, return_tensors="pt")
    pieces = TEXT.split("[IMG]")
    laid_out = []
    for h, w in pixels["image_sizes"].tolist():  # PixtralProcessor's rows: [IMG] per token, [IMG_BREAK] / [IMG_END]
        rows = ["[IMG]" * (w // 14)] * (h // 14)
        laid_out.append("[IMG_BREAK]".join(rows) + "[IMG_END]")
    expanded = pieces[0] + "".join(tokens + piece for tokens, piece in zip(laid_out, pieces[1:]))
    prompt = AutoTokenizer.from_pretrained(str(folder))(expanded).input_ids
    kwargs = {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, **kwargs)
    want = out[0, len(prompt):].tolist()

    def logprobs(tokens: list[int]) -> list[float]:
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = hf(input_ids=ids, **kwargs).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()

    return prompt, want, logprobs


@pytest.fixture(scope="module")
def mistral3_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral3-hf")
    hf = make_tiny_mistral3(folder, TINY_CORPUS, seed=4, image_size=IMAGE_SIZE)
    half_rounded(hf)
    files = tmp_path_factory.mktemp("mistral3-gguf")
    texts = {arch: write_text_gguf(files / f"{arch}.gguf", hf, folder / "tokenizer.json", arch)
             for arch in ("llama", "mistral3")}
    return folder, hf, texts, write_pixtral_mmproj(files / "mmproj.gguf", hf, folder)


@pytest.mark.parametrize("arch", ["llama", "mistral3"])
def test_the_gguf_and_its_mmproj_equal_transformers(mistral3_files, tmp_path, arch):
    folder, hf, texts, mmproj = mistral3_files
    images = [random_image(1, size=SIZES[0]), random_image(2, size=SIZES[1])]
    prompt, want, logprobs = hf_reference(hf, folder, images, N)
    with LLM(texts[arch], mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache") as llm:
        assert llm.engine.supports_images and llm.engine.router.full_config.model_type == "mistral3"
        assert llm.engine.router.config.model_type in ("mistral", "llama")  # (as transformers reads arch llama)
        text_only = check_image_prompt(llm, TEXT, images, prompt, want, logprobs, N)
        assert_vision_weights_equal(llm, hf)
    ids = torch.tensor([text_only.prompt_token_ids])
    with torch.no_grad():
        plain = hf.generate(input_ids=ids, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert text_only.outputs[0].token_ids == plain[0, ids.shape[1]:].tolist()


def test_two_ranks_give_one_ranks_tokens(mistral3_files, tmp_path):
    folder, hf, texts, mmproj = mistral3_files
    images = [random_image(3, size=SIZES[0]), random_image(4, size=SIZES[1])]
    _, want, _ = hf_reference(hf, folder, images, N)
    with LLM(texts["mistral3"], mmproj=mmproj, dtype="float32", num_kv_blocks=64, show_progress=False,
             cache_dir=tmp_path / "cache", tensor_parallel_size=2) as llm:
        got = llm.generate(image_prompt(TEXT, images), greedy(N), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want


def test_refusals(mistral3_files, tmp_path):
    folder, hf, texts, mmproj = mistral3_files
    no_merger = write_pixtral_mmproj(tmp_path / "pixtral-12b.gguf", hf, folder, merger=False)
    with pytest.raises(MmprojError, match="without a patch merger"):
        LLM(texts["llama"], mmproj=no_merger, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    qwen_gguf = write_model_gguf(tmp_path / "qwen2.gguf", qwen, folder / "tokenizer.json", "qwen2")
    with pytest.raises(MmprojError, match="goes with the GGUF of Mistral Small 3.1 / 3.2"):
        LLM(qwen_gguf, mmproj=mmproj, dtype="float32", show_progress=False, cache_dir=tmp_path / "cache")
