"""A llama.cpp multimodal projector file (`--mmproj`, beside a GGUF language model): the
vision tower and projector its converter writes as a separate GGUF of arch "clip".

Read for Qwen's image-text models (gguf_mmproj_qwen.py), Mistral Small 3.1 / 3.2
(gguf_mmproj_pixtral.py), Gemma 4 (gguf_mmproj_gemma4.py), SmolVLM and Idefics3
(gguf_mmproj_idefics3.py) and Gemma 3 (clip projector type "gemma3"): the SigLIP tower's shape and the image
processor's size, mean and std come from its `clip.vision.*` keys; the tokens an image
takes from the patch grid and the projector's pooling (`projector.scale_factor`, 4 where
absent, as llama.cpp assumes). With the converted text GGUF's config and tokenizer they
make the folder a Hugging Face Gemma 3 checkpoint would have (config.json for
`Gemma3ForConditionalGeneration`, the processor's files), so the multimodal path runs
unchanged. The tensors keep the Hugging Face layout (the converter writes them as they
are), under the names gguf's TensorNameMap gives them (Gemma 3's and SmolVLM's alike); the
projector's soft-embedding norm is stored as 1 + w, as llama.cpp's Gemma norms are."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from tessera.weights.gguf_clip import MmprojError, torch_shape, vision_key
from tessera.weights.gguf_mmproj_gemma4 import PROJECTOR_TYPE as GEMMA4V
from tessera.weights.gguf_mmproj_gemma4 import iter_gemma4_weights, write_gemma4_folder
from tessera.weights.gguf_mmproj_idefics3 import PROJECTOR_TYPE as IDEFICS3
from tessera.weights.gguf_mmproj_idefics3 import write_idefics3_folder
from tessera.weights.gguf_mmproj_pixtral import PROJECTOR_TYPE as PIXTRAL
from tessera.weights.gguf_mmproj_pixtral import iter_pixtral_weights, write_mistral3_folder
from tessera.weights.gguf_mmproj_qwen import QWEN_PROJECTORS, iter_qwen_vl_weights, write_qwen_vl_folder
from tessera.weights.gguf_rope import field_value

logger = logging.getLogger(__name__)

PROJECTOR_TYPES = ("gemma3", GEMMA4V, IDEFICS3, PIXTRAL, *QWEN_PROJECTORS)
DEFAULT_SCALE_FACTOR = 4  # llama.cpp's Gemma 3 pooling (896-pixel images, 64 x 64 patches -> 16 x 16)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
SOFT_EMB_NORM = "mm.soft_emb_norm.weight"
CONVERSION_VERSION = 1


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise MmprojError(f"{path} is not a readable GGUF file: {exc}") from exc


def _projector_type(fields: dict, path: Path) -> str:
    if field_value(fields, "general.architecture") != "clip":
        raise MmprojError(f"{path.name} is not a multimodal projector (its GGUF arch is "
                          f"{field_value(fields, 'general.architecture')!r}, not 'clip')")
    kind = field_value(fields, "clip.vision.projector_type") or field_value(fields, "clip.projector_type")
    if kind not in PROJECTOR_TYPES:
        raise MmprojError(f"{path.name}: projector type {kind!r} is not read "
                          f"(tessera reads {', '.join(PROJECTOR_TYPES)})")
    if field_value(fields, "clip.has_vision_encoder") is False:
        raise MmprojError(f"{path.name} has no vision encoder")
    return kind


def _vision(fields: dict) -> dict[str, Any]:
    def key(name: str) -> Any:
        return vision_key(fields, name)

    return dict(model_type="siglip_vision_model", hidden_size=int(key("embedding_length")),
                intermediate_size=int(key("feed_forward_length")), num_hidden_layers=int(key("block_count")),
                num_attention_heads=int(key("attention.head_count")), image_size=int(key("image_size")),
                patch_size=int(key("patch_size")), layer_norm_eps=float(key("attention.layer_norm_epsilon")),
                hidden_act="gelu_pytorch_tanh", vision_use_head=False)


def gguf_mmproj_folder(text_folder: Path, mmproj: Path, cache_dir: Path) -> Path:
    """The image-text checkpoint's metadata folder for the converted text GGUF (`text_folder`,
    gguf.gguf_metadata_folder's) and the projector file; made once, cached beside it."""
    mmproj = Path(mmproj).expanduser()
    if not mmproj.is_file():
        raise MmprojError(f"--mmproj {mmproj}: no such file")
    stat = mmproj.stat()
    where = hashlib.sha256(f"{mmproj.resolve()}|{text_folder.name}".encode()).hexdigest()[:12]
    folder = Path(cache_dir) / "gguf" / f"{text_folder.name}+{mmproj.stem}-{stat.st_size}-{stat.st_mtime_ns}-{where}"
    marker = folder / "tessera-conversion.json"
    if marker.is_file():
        return folder
    reader = _reader(mmproj)
    kind = _projector_type(reader.fields, mmproj)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    if kind in QWEN_PROJECTORS:
        write_qwen_vl_folder(tmp, text_folder, reader.fields, reader.tensors, kind)
    elif kind == PIXTRAL:
        write_mistral3_folder(tmp, text_folder, reader.fields, reader.tensors)
    elif kind == GEMMA4V:
        write_gemma4_folder(tmp, text_folder, reader.fields, reader.tensors)
    elif kind == IDEFICS3:
        write_idefics3_folder(tmp, text_folder, reader.fields)
    else:
        _write_gemma3(tmp, text_folder, reader.fields)
    for item in text_folder.iterdir():  # the text file's tensor index, which its loader reads
        if item.suffix == ".json" and item.name.startswith("gguf-"):
            shutil.copy(item, tmp / item.name)
    (tmp / "tessera-conversion.json").write_text(json.dumps({"text": str(text_folder), "mmproj": str(mmproj),
                                                             "version": CONVERSION_VERSION}))
    if folder.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(folder)
    return folder


def _write_gemma3(folder: Path, text_folder: Path, fields: dict) -> None:
    from transformers import Gemma3Config, Gemma3Processor, Gemma3TextConfig, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    kind = json.loads((text_folder / "config.json").read_text()).get("model_type")
    if kind != "gemma3_text":
        raise MmprojError(f"a Gemma 3 projector goes with a Gemma 3 GGUF, not a {kind} one")
    text = Gemma3TextConfig.from_pretrained(str(text_folder))
    vision = _vision(fields)
    scale = int(field_value(fields, "clip.vision.projector.scale_factor") or DEFAULT_SCALE_FACTOR)
    side = vision["image_size"] // vision["patch_size"]
    if side % scale:
        raise MmprojError(f"the projector pools {side} x {side} patches by {scale}: not a whole grid")
    tokens = (side // scale) ** 2
    # the converted tokenizer.json as it is (a class of its own would rebuild parts of it),
    # naming the image tokens the processor looks for
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(text_folder), extra_special_tokens=GEMMA3_TOKENS)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_TOKENS.items()}
    missing = [GEMMA3_TOKENS[n] for n, i in ids.items() if not isinstance(i, int) or i == tokenizer.unk_token_id]
    if missing:
        raise MmprojError(f"the GGUF's vocabulary lacks Gemma 3's image tokens {missing}")
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=tokens,
                          boi_token_index=ids["boi_token"], image_token_index=ids["image_token"],
                          eoi_token_index=ids["eoi_token"], eos_token_id=text.eos_token_id,
                          architectures=["Gemma3ForConditionalGeneration"])
    mean = field_value(fields, "clip.vision.image_mean") or [0.5, 0.5, 0.5]
    std = field_value(fields, "clip.vision.image_std") or [0.5, 0.5, 0.5]
    size = vision["image_size"]
    images = Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=list(mean), image_std=list(std))
    Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=tokens,
                    chat_template=tokenizer.chat_template).save_pretrained(str(folder))
    config.save_pretrained(str(folder))


def _as_released(name: str) -> str:
    """A vision weight's name as the released checkpoints (which the converter read) have
    it: no "model." in front, SigLIP's "vision_model." level kept."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def mmproj_tensor_names(hf_names: Iterable[str], num_blocks: int) -> dict[str, str]:
    """{llama.cpp name: the Hugging Face name given} for the vision side's weights."""
    from gguf import MODEL_ARCH, TensorNameMap

    table = TensorNameMap(MODEL_ARCH.MMPROJ, num_blocks)
    out = {}
    for hf in hf_names:
        converted = _as_released(hf).replace("_weight", ".weight")  # as the converter renames the projector's
        name = table.get_name(converted, try_suffixes=(".weight", ".bias"))
        if name is None:  # (Idefics3's released names keep the "model." in front)
            name = table.get_name("model." + converted, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise MmprojError(f"{hf}: no llama.cpp name for it")
        out[name] = hf
    return out


def _read_array(tensor) -> np.ndarray:
    """A projector tensor as a writable float32 array of its torch shape."""
    from gguf import dequantize

    shape = torch_shape(tensor)
    return np.array(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape))


def iter_mmproj_weights(path: Path, hf_names: Iterable[str], buffer_names: Iterable[str] = ()
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for each of `hf_names` (the vision side's
    weights) from the projector file; a name the file lacks, or a tensor the model has no
    weight for, is an error."""
    reader = _reader(Path(path))
    kind = _projector_type(reader.fields, Path(path))
    if kind in QWEN_PROJECTORS:  # (names as the released checkpoints have them; the tower checks them)
        yield from iter_qwen_vl_weights(reader.tensors, kind, _read_array)
        return
    if kind == PIXTRAL:
        yield from iter_pixtral_weights(reader.fields, reader.tensors, _read_array)
        return
    if kind == GEMMA4V:  # (its clipped linears' bounds and standardization are buffers)
        yield from iter_gemma4_weights(reader.fields, reader.tensors, [*hf_names, *buffer_names], _read_array)
        return
    names = mmproj_tensor_names(hf_names, int(field_value(reader.fields, "clip.vision.block_count") or 0))
    found = set()
    for tensor in reader.tensors:
        hf = names.get(tensor.name)
        if hf is None:
            raise MmprojError(f"{Path(path).name}: tensor {tensor.name} has no place in the vision tower")
        array = _read_array(tensor)
        if tensor.name == SOFT_EMB_NORM:
            array = array - np.float32(1.0)
        found.add(tensor.name)
        yield hf, torch.from_numpy(array)
    missing = sorted(set(names) - found)
    if missing:
        raise MmprojError(f"{Path(path).name} lacks {', '.join(missing[:6])}")
