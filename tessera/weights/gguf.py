"""GGUF files: tensors dequantized with the `gguf` package and renamed to Hugging Face names;
config and tokenizer converted once by transformers and cached as a plain folder, with an
index of the tensors (where each lies in the file), so later loads map the file directly:
the `gguf` package's reader parses every metadata value first, 3.4 s for the default
model's 49k-token vocabulary, on every start.

llama.cpp's converter permutes the rows of Q and K for llama-family models (it uses the
interleaved rotary layout); models that need it set `gguf_permute_qk`, and we undo it here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from tessera.weights.gguf_cohere2 import ARCH as COHERE2
from tessera.weights.gguf_cohere2 import cohere2_config
from tessera.weights.gguf_config import complete_gguf_config
from tessera.weights.gguf_deepseek2 import ARCH as DEEPSEEK2
from tessera.weights.gguf_deepseek2 import deepseek2_config
from tessera.weights.gguf_ernie4_5 import ARCHES as ERNIE4_5_ARCHES
from tessera.weights.gguf_ernie4_5 import ernie4_5_config
from tessera.weights.gguf_falcon_h1 import ARCH as FALCON_H1
from tessera.weights.gguf_falcon_h1 import falcon_h1_config
from tessera.weights.gguf_gemma4 import ARCH as GEMMA4
from tessera.weights.gguf_gemma4 import gemma4_config
from tessera.weights.gguf_glm4 import ARCH as GLM4
from tessera.weights.gguf_glm4 import glm4_config
from tessera.weights.gguf_glm4moe import ARCH as GLM4MOE
from tessera.weights.gguf_glm4moe import glm4moe_config
from tessera.weights.gguf_gpt_oss import ARCH as GPT_OSS
from tessera.weights.gguf_gpt_oss import gpt_oss_config
from tessera.weights.gguf_granite import ARCH as GRANITE
from tessera.weights.gguf_granite import granite_config
from tessera.weights.gguf_granitehybrid import ARCH as GRANITEHYBRID
from tessera.weights.gguf_granitehybrid import granitehybrid_config
from tessera.weights.gguf_lfm2 import ARCHES as LFM2_ARCHES
from tessera.weights.gguf_lfm2 import lfm2_config
from tessera.weights.gguf_mistral3 import ARCH as MISTRAL3
from tessera.weights.gguf_mistral3 import mistral3_config
from tessera.weights.gguf_mxfp4 import MXFP4, mxfp4_parts
from tessera.weights.gguf_nemotron_h import ARCHES as NEMOTRON_H_ARCHES
from tessera.weights.gguf_nemotron_h import nemotron_h_config
from tessera.weights.gguf_olmo2 import ARCH as OLMO2
from tessera.weights.gguf_olmo2 import olmo2_config
from tessera.weights.gguf_pretokenizers import apply_gguf_pretokenizer
from tessera.weights.gguf_q4 import Q4Rows, is_q4
from tessera.weights.gguf_qwen35 import ARCHES as QWEN35_ARCHES
from tessera.weights.gguf_qwen35 import qwen35_config
from tessera.weights.gguf_qwen_vl import ARCHES as QWEN_VL_ARCHES
from tessera.weights.gguf_qwen_vl import qwen_vl_text_config
from tessera.weights.gguf_rope import ROPE_TENSORS, field_value
from tessera.weights.gguf_smollm3 import ARCH as SMOLLM3
from tessera.weights.gguf_smollm3 import smollm3_config
from tessera.weights.lazy import LazyTensor

logger = logging.getLogger(__name__)

# llama.cpp tensor names (shared by its decoder architectures) -> Hugging Face names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    # per-layer embeddings (Gemma 4)
    "per_layer_token_embd": "model.embed_tokens_per_layer", "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# blk.N.part.weight, or blk.N.part.E.weight: one expert's tensor in older MoE files; some
# parts carry a .scale (Gemma 4's router)
# (parts may be dotted: LFM2's shortconv.conv; a few tensors have no kind: Qwen3.5's ssm_a)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z][a-z0-9_]*(?:\.(?!(?:weight|bias|scale)$)[a-z][a-z0-9_]*)*)"
                       r"(?:\.(\d+))?(?:\.(weight|bias|scale))?$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
CONVERSION_VERSION = 9  # bump when the cached folder's contents change
TENSOR_INDEX = "gguf-tensors.json"
EXPERT = "{e}"  # in a Hugging Face name: one tensor per expert (a stacked GGUF tensor is split)
LAZY_BYTES = 256 << 20  # 2-D tensors larger than this in float32 are read by rows (GGUFRows)


def hf_tensor_name(gguf_name: str, names: Mapping[str, str] | None = None,
                   global_names: Mapping[str, str] | None = None) -> str:
    """The Hugging Face name of a llama.cpp tensor. `names` (a router's `gguf_names`) adds or
    overrides layer parts (e.g. Gemma 2's four norms, MoE experts); a name holding EXPERT
    stands for one tensor per expert, filled in from an old per-expert GGUF name
    ("ffn_gate.{e}") or left for the caller to split a stacked one ("ffn_gate_exps"). A key
    "part.kind" names the whole tensor (Gemma 4's "ffn_gate_inp.scale": "router.scale").
    `global_names` (a router's `gguf_global_names`) adds tensors outside the blocks."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, expert, kind = m.groups()
        table = {**_LAYER_NAMES, **(names or {})}
        if expert is None and f"{part}.{kind}" in table:
            return f"model.layers.{layer}.{table[f'{part}.{kind}']}"
        key = part if expert is None else f"{part}.{EXPERT}"
        if key not in table:
            raise KeyError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
        target = table[key] if expert is None else table[key].replace(EXPERT, expert)
        return f"model.layers.{layer}.{target}" + (f".{kind}" if kind else "")
    stem, _, kind = gguf_name.rpartition(".")
    table = {**_GLOBAL_NAMES, **(global_names or {})}
    if stem not in table:
        raise KeyError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
    return f"{table[stem]}.{kind}"


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved rotary halves back to rotate-half rows."""
    head_rows = w.shape[0] // num_heads
    return w.reshape(num_heads, head_rows // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor lies in the file, as the `gguf` reader found it."""

    name: str
    tensor_type: int          # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]    # GGUF order (fastest dimension first)
    data_shape: tuple[int, ...]  # the stored array: bytes per row for quantized types
    data_dtype: str
    offset: int               # from the start of the file
    n_bytes: int


def tensor_index(reader) -> list[GGUFTensor]:
    """The tensors a `gguf.GGUFReader` found, as an index that can be cached."""
    return [GGUFTensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape),
                       tuple(int(d) for d in t.data.shape), t.data.dtype.str, int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors]


def _cached_tensor_index(path: Path, index_dir: Path | None) -> list[GGUFTensor]:
    index = None if index_dir is None else Path(index_dir) / TENSOR_INDEX
    if index is not None and index.is_file():
        return [GGUFTensor(**{**t, "shape": tuple(t["shape"]), "data_shape": tuple(t["data_shape"])})
                for t in json.loads(index.read_text())]
    from gguf import GGUFReader

    return tensor_index(GGUFReader(str(path)))


def gguf_matrix_format(path: Path, index_dir: Path | None = None) -> str | None:
    """The storage type most of the file's weight matrices (2-D tensors) use, e.g. "Q4_1";
    None if it has none."""
    from gguf import GGMLQuantizationType

    main = _main_matrix_type(_cached_tensor_index(path, index_dir))
    return None if main is None else GGMLQuantizationType(main).name


def _main_matrix_type(tensors: list[GGUFTensor]) -> int | None:
    counts = Counter(t.tensor_type for t in tensors if len(t.shape) == 2)
    return counts.most_common(1)[0][0] if counts else None


def _bits_per_weight(tensor_type: int) -> float:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
    return 8 * size / block


def iter_gguf_weights(path: Path, *, permute_qk: bool, num_heads: int, num_kv_heads: int,
                      index_dir: Path | None = None, names: Mapping[str, str] | None = None,
                      norm_offset: float = 0.0, num_layers: int | None = None,
                      packed: tuple[str, ...] = (), global_names: Mapping[str, str] | None = None,
                      plain_norms: tuple[str, ...] = (), int4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file; `index_dir` is the
    converted metadata folder holding the tensor index (without one, the file is parsed).
    `names`: the router's extra llama.cpp names (hf_tensor_name); `norm_offset` is taken off
    every norm weight (llama.cpp stores Gemma's (1 + w) RMSNorm weights with the 1 added)
    but those whose names end as `plain_norms` do (Qwen3.5's gated norm is a plain one).
    Blocks from `num_layers` on are skipped: the multi-token-prediction layers llama.cpp
    writes after the model's (GLM-4.5's `nextn`). With "mxfp4" in `packed` (a model that
    runs MXFP4 stacks as stored), MXFP4 tensors come as their `_blocks` and `_scales` parts
    in OpenAI's layout (gguf_mxfp4.py) instead of dequantized. `int4` (the model's linear layers
    take tessera's int4 format): Q4_0, Q4_1 and Q4_K matrices come as Q4Rows, whose stored codes
    and scales those layers take as they are (gguf_q4.py); in a file mostly 4-bit, the other
    matrices stored at more than 5 bits a weight are marked `stored_wider` (int8 for them)."""
    tensors = _cached_tensor_index(path, index_dir)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    main = _main_matrix_type(tensors)
    # a file mostly 4-bit that keeps some matrices wider (llama.cpp's K-quant mixes: Q6_K
    # attn_v and ffn_down in Q4_K_M): int4 layers take int8 for those (ops/linear_int4.py)
    mostly_q4 = int4 and main is not None and is_q4(main)
    for tensor in tensors:
        if tensor.name in ROPE_TENSORS:  # read into the config at conversion (gguf_rope.py)
            continue
        block = _BLOCK_RE.match(tensor.name)
        if block and num_layers is not None and int(block.group(1)) >= num_layers:
            continue
        data = mapped[tensor.offset:tensor.offset + tensor.n_bytes].view(np.dtype(tensor.data_dtype))
        data = data.reshape(tensor.data_shape)
        name = hf_tensor_name(tensor.name, names, global_names)
        if "mxfp4" in packed and tensor.tensor_type == MXFP4 and EXPERT in name:  # (stacks only)
            yield from mxfp4_parts(name.replace(f".{EXPERT}", ""), data)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        wider = mostly_q4 and _bits_per_weight(tensor.tensor_type) > 5
        if EXPERT in name:
            # A stacked [experts, rows, cols] tensor: dequantized one expert at a time, so
            # the float32 copy in flight is one expert's (a whole Mixtral-8x7B tensor would
            # be 1.9 GB); GGUF quant blocks run along the last dimension, so each expert's
            # bytes are a contiguous slice.
            for e in range(shape[0]):
                expert = name.replace(EXPERT, str(e))
                if int4 and is_q4(tensor.tensor_type):  # (its stored parts too)
                    yield expert, Q4Rows(expert, tensor.tensor_type, data[e], shape[1:], lazy=False)
                    continue
                out = torch.from_numpy(_dequantized(tensor, data[e], shape[1:]))
                if wider:  # (a K-quant mix's Q6_K ffn_down_exps: int4 stacks take this one in int8)
                    out.stored_wider = True
                yield expert, out
            continue
        if int4 and len(shape) == 2 and is_q4(tensor.tensor_type):
            if permute_qk and name.endswith("q_proj.weight"):  # (rows of blocks move whole)
                data = unpermute_rows(data, num_heads)
            elif permute_qk and name.endswith("k_proj.weight"):
                data = unpermute_rows(data, num_kv_heads)
            yield name, Q4Rows(name, tensor.tensor_type, data, shape, lazy=shape[0] * shape[1] * 4 > LAZY_BYTES)
            continue
        if len(shape) == 2 and shape[0] * shape[1] * 4 > LAZY_BYTES and not (
                permute_qk and name.endswith(("q_proj.weight", "k_proj.weight"))):  # (those are un-permuted whole)
            rows = GGUFRows(tensor, data, shape)  # dequantized by rows as the loader reads them
            rows.stored_wider = wider
            yield name, rows
            continue
        array = _dequantized(tensor, data, shape)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = unpermute_rows(array, num_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = unpermute_rows(array, num_kv_heads)
        if norm_offset and name.endswith("norm.weight") and not name.endswith(plain_norms):
            array -= np.float32(norm_offset)
        out = torch.from_numpy(array)
        if wider and len(shape) == 2:
            out.stored_wider = True
        yield name, out


class GGUFRows(LazyTensor):
    """A large 2-D tensor (a vocabulary table: Gemma 4's per-layer one is 262144 x 8960)
    dequantized when read, by rows where a loader narrows it (quant blocks run along rows, so
    a span of rows is a span of bytes): a loader that copies it in slices (ops/embedding.py)
    never holds all of it in float32."""

    def __init__(self, tensor: GGUFTensor, data: np.ndarray, shape: tuple[int, int]):
        self.gguf_tensor, self.data, self.shape, self.name = tensor, data, torch.Size(shape), tensor.name

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.load().narrow(dim, start, length)
        rows = self.data[start:start + length]
        return torch.from_numpy(_dequantized(self.gguf_tensor, rows, (length, self.shape[1])))

    def load(self) -> torch.Tensor:
        return torch.from_numpy(_dequantized(self.gguf_tensor, self.data, tuple(self.shape)))


def _dequantized(tensor: GGUFTensor, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A writable float32 array of `shape` (Hugging Face order) from the stored `data`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensor_type = GGMLQuantizationType(tensor.tensor_type)
    try:
        array = dequantize(data, tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"{tensor.name}: GGUF type {tensor_type.name} cannot be "
                         f"dequantized by the installed gguf package ({exc})") from exc
    # Quantized tensors come back as fresh arrays; F32 ones are views of the read-only
    # memory map, so copy those (torch needs writable memory).
    return np.array(array.reshape(shape), dtype=np.float32, copy=not array.flags.writeable)


# tessera's own config readers, by GGUF architecture: completed after like transformers'
# conversions (gguf_config.py), or complete as they are (their rope and head sizes are theirs)
OWN_READERS: dict[str, Callable[[dict, list], Any]] = {
    SMOLLM3: smollm3_config, MISTRAL3: mistral3_config, GLM4: glm4_config, GLM4MOE: glm4moe_config,
    GPT_OSS: gpt_oss_config, GRANITE: granite_config, GRANITEHYBRID: granitehybrid_config, OLMO2: olmo2_config,
    COHERE2: cohere2_config, FALCON_H1: falcon_h1_config, **{arch: lfm2_config for arch in LFM2_ARCHES},
    **{arch: qwen35_config for arch in QWEN35_ARCHES}, **{arch: ernie4_5_config for arch in ERNIE4_5_ARCHES},
    **{arch: qwen_vl_text_config for arch in QWEN_VL_ARCHES}, **{arch: nemotron_h_config for arch in NEMOTRON_H_ARCHES}}
COMPLETE_READERS: dict[str, Callable[[dict, list], Any]] = {GEMMA4: gemma4_config, DEEPSEEK2: deepseek2_config}
# the archs of natively served types whose config transformers' conversion reads (completed after)
TRANSFORMERS_READ = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "minimax-m2")


def gguf_metadata_folder(path: Path, cache_dir: Path) -> Path:
    """A folder with config.json and tokenizer files converted from the GGUF by transformers.

    The conversion reads the whole vocabulary in Python (seconds); it runs once per file and
    is cached under `cache_dir/gguf/`, keyed by the file's name, size and mtime.
    """
    stat = path.stat()
    # The path is part of the key: two files of one name, size and mtime in different
    # folders (two fine-tunes at one quant type, copied with `cp -p`) are not the same.
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    key = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{where}-v{CONVERSION_VERSION}"
    folder = Path(cache_dir) / "gguf" / key
    marker = folder / "tessera-conversion.json"
    if marker.is_file():
        return folder
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    logger.info("converting GGUF metadata and tokenizer of %s once (cached in %s)", path.name, folder)
    try:
        reader = GGUFReader(str(path))  # parsed once for the flags, head_dim and the tensor index
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    parts = field_value(reader.fields, "split.count")
    if parts is not None and int(parts) > 1:
        raise ValueError(f"{path.name} is one of {int(parts)} parts of a split GGUF, which tessera does not "
                         "load; merge them first: llama-gguf-split --merge FIRST-PART OUT.gguf")
    index = tensor_index(reader)
    arch = field_value(reader.fields, "general.architecture")
    if arch in COMPLETE_READERS or arch in OWN_READERS:
        # architectures transformers' conversion refuses (Gemma 4's per-layer KV heads and
        # widths) or does not know; their tokenizers then load without a config
        if arch in COMPLETE_READERS:
            config = COMPLETE_READERS[arch](reader.fields, reader.tensors)
        else:
            config = complete_gguf_config(OWN_READERS[arch](reader.fields, reader.tensors), reader.fields,
                                          reader.tensors)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        try:
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError as exc:
            if "not supported" not in str(exc):
                raise
            read = sorted({*OWN_READERS, *COMPLETE_READERS, *TRANSFORMERS_READ})
            raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not read by tessera (it reads "
                             f"{', '.join(read)}); serve the model's Hugging Face folder instead") from exc
        config = complete_gguf_config(config, reader.fields, reader.tensors)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    apply_gguf_pretokenizer(tokenizer, reader.fields)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / TENSOR_INDEX).write_text(json.dumps([asdict(t) for t in index]))
    (tmp / "tessera-conversion.json").write_text(json.dumps({"source": str(path), "version": CONVERSION_VERSION}))
    if folder.exists():  # another process won the race; theirs is as good as ours
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(folder)
    return folder
