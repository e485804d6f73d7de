"""Pre-quantized checkpoints (weights/prequantized.py): tiny Llama checkpoints quantized the
way each tool writes them, loaded by tessera, and checked against the same model with the
dequantized weights: greedy tokens and log-probabilities (float32).

- compressed-tensors: written by the compressed-tensors library itself (as llm-compressor
  does); the reference weights are the library's own quantize-dequantize, and for the
  schemes transformers loads (FP8 per channel, int4 symmetric groups), transformers'
  from_pretrained of the checkpoint too.
- fp8 blocks (transformers' FineGrainedFP8), GPTQ and AWQ: written here from the formats'
  published layouts (GPTQ: input rows packed 8 to an int32, zero points stored minus one;
  AWQ: output columns packed with its interleaved nibble order).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tessera import LLM, SamplingParams
from tessera.config import ConfigError
from tests.models.parity import check_greedy_and_logprobs, make_tiny, prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 8


def tiny_llama(folder: Path, tokenizer_dir: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return make_tiny(folder, tokenizer_dir, LlamaConfig, LlamaForCausalLM, seed=seed)


def linears(model: torch.nn.Module):
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            yield name, module


def load(folder: Path, tmp_path: Path) -> LLM:
    return LLM(folder, dtype="float32", num_kv_blocks=32, show_progress=False, cache_dir=tmp_path / "cache")


def prompts() -> list[list[int]]:
    return [prompt_ids(7, 1), prompt_ids(30, 2)]


def rewrite_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    """Replace the folder's weights with `tensors` and declare `quantization_config`."""
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_int32_inverts_compressed_tensors_packing(bits, dim):
    """Every width, both directions: the library's dense packing (values straddle words at
    3, 5, 6, 7 bits), with a length that leaves the last word part-filled."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tessera.weights.dequantize import unpack_int32

    g = torch.Generator().manual_seed(bits)
    shape = (37, 6) if dim == 0 else (6, 37)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, generator=g, dtype=torch.int8)
    packed = pack_to_int32(values, bits, packed_dim=dim)
    unpacked = unpack_int32(packed, bits, shape[dim], dim) - (1 << (bits - 1))
    assert torch.equal(unpacked.to(torch.int8), values)


# --- compressed-tensors, written by its own library -------------------------------------

CT_SCHEMES = {
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel", symmetric=True)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor", symmetric=True)),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", strategy="block", symmetric=True,
                                          block_structure=[16, 32])),
    "int4-group": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)),
    "int4-group-asym": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=16,
                                               symmetric=False)),
    "int8-channel-packed": ("pack-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True)),
    "int8-channel": ("int-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True)),
    "int3-channel-asym": ("pack-quantized", dict(num_bits=3, type="int", strategy="channel", symmetric=False)),
}


def write_compressed_tensors(folder: Path, model: torch.nn.Module, fmt: str, args: dict) -> torch.nn.Module:
    """Quantize `model`'s linears (lm_head ignored) with compressed-tensors, save it compressed
    in `folder`, and return the reference: the model with the library's dequantized weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    reference = copy.deepcopy(model)
    quant_args = QuantizationArgs(**args)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=quant_args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for (name, module), (_, ref) in zip(linears(model), linears(reference)):
            w = module.weight
            if quant_args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif quant_args.strategy == "group":
                grouped = w.reshape(w.shape[0], -1, quant_args.group_size)
                lo, hi = grouped.amin(2), grouped.amax(2)
            elif quant_args.strategy == "block":
                b0, b1 = quant_args.block_structure
                blocks = w.reshape(w.shape[0] // b0, b0, w.shape[1] // b1, b1)
                lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, quant_args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
            ref.weight.copy_(fake_quantize(w, module.weight_scale, module.weight_zero_point, quant_args))
            assert not torch.equal(ref.weight, w)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return reference.eval()


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_checkpoints(scheme, tiny_tokenizer_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    fmt, args = CT_SCHEMES[scheme]
    folder = tmp_path / scheme
    reference = write_compressed_tensors(folder, tiny_llama(folder, tiny_tokenizer_dir), fmt, args)
    stored = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert stored["quant_method"] == "compressed-tensors" and stored["format"] == fmt
    check_greedy_and_logprobs(load(folder, tmp_path), reference, prompts(), NEW_TOKENS)


def test_compressed_tensors_group_index(tiny_tokenizer_dir, tmp_path):
    """Older compressed-tensors GPTQ exports (actorder "group") carry weight_g_idx, a column's
    group: here the groups' scales are stored shuffled, and g_idx points each column to its
    own, so only a loader that follows g_idx gets the reference weights."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file

    fmt, args = CT_SCHEMES["int4-group"]
    folder = tmp_path / "g_idx"
    reference = write_compressed_tensors(folder, tiny_llama(folder, tiny_tokenizer_dir), fmt, args)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        scale = tensors[name]
        shuffled = torch.roll(torch.arange(scale.shape[1]), 1)  # group g is stored at shuffled[g]
        cols = tensors[name.replace("weight_scale", "weight_shape")][1].item()
        tensors[name] = scale[:, torch.argsort(shuffled)]
        tensors[name.replace("weight_scale", "weight_g_idx")] = shuffled[torch.arange(cols) // args["group_size"]]
    save_file(tensors, str(folder / "model.safetensors"))
    check_greedy_and_logprobs(load(folder, tmp_path), reference, prompts(), NEW_TOKENS)


@pytest.mark.parametrize("scheme", ["fp8-channel", "int4-group"])
def test_compressed_tensors_match_transformers_loading_them(scheme, tiny_tokenizer_dir, tmp_path):
    """transformers' own loader of the compressed checkpoint (through compressed-tensors)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    fmt, args = CT_SCHEMES[scheme]
    folder = tmp_path / scheme
    write_compressed_tensors(folder, tiny_llama(folder, tiny_tokenizer_dir), fmt, args)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    check_greedy_and_logprobs(load(folder, tmp_path), hf, prompts(), NEW_TOKENS)


# --- formats written here from their layouts --------------------------------------------

def asymmetric_groups(w: torch.Tensor, group_size: int, bits: int = 4):
    """Per-group unsigned quantization of an [out, in] weight: q [out, in], zero points and
    fp16-representable scales [out, groups], and the dequantized weight. Zero points stay
    in 1..15 (GPTQ's v1 format stores them minus one)."""
    out, cols = w.shape
    grouped = w.reshape(out, cols // group_size, group_size)
    lo, hi = grouped.amin(2).clamp(max=0), grouped.amax(2).clamp(min=0)
    top = 2 ** bits - 1
    scales = ((hi - lo) / top).clamp(min=1e-8).half().float()
    zeros = torch.round(-lo / scales).clamp(1, top)
    q = torch.clamp(torch.round(grouped / scales[..., None]) + zeros[..., None], 0, top)
    dense = ((q - zeros[..., None]) * scales[..., None]).reshape(out, cols)
    return q.reshape(out, cols).to(torch.int64), zeros.to(torch.int64), scales, dense


def pack_rows(values: torch.Tensor, bits: int = 4, order=None) -> torch.Tensor:
    """Unsigned ints packed along dim 0, 32 // bits rows to an int32: slot k (bits k * bits
    and up) holds row k of each run, or row order[k]."""
    per_word = 32 // bits
    v = values.reshape(values.shape[0] // per_word, per_word, *values.shape[1:])
    if order is not None:
        v = v[:, list(order)]
    packed = torch.zeros(v.shape[0], *v.shape[2:], dtype=torch.int64)
    for slot in range(per_word):
        packed |= v[:, slot] << (bits * slot)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def write_gptq(folder: Path, model: torch.nn.Module, group_size: int, act_order: bool,
               v2: bool = False) -> torch.nn.Module:
    """GPTQ: qweight [in / 8, out] (input rows packed), qzeros [groups, out / 8] (v1: minus
    one), scales [groups, out] fp16, g_idx [in] (a column's group: permuted with act-order)."""
    reference, tensors = copy.deepcopy(model), dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    for (name, module), (_, ref) in zip(linears(model), linears(reference)):
        w = module.weight.detach()
        cols = w.shape[1]
        perm = torch.randperm(cols, generator=g) if act_order else torch.arange(cols)
        q, zeros, scales, dense = asymmetric_groups(w[:, perm], group_size)
        inverse = torch.argsort(perm)  # back to the checkpoint's column order
        del tensors[f"{name}.weight"]
        tensors[f"{name}.qweight"] = pack_rows(q[:, inverse].T)
        tensors[f"{name}.qzeros"] = pack_rows(zeros - (0 if v2 else 1)).T
        tensors[f"{name}.scales"] = scales.T.half()
        tensors[f"{name}.g_idx"] = (torch.arange(cols) // group_size)[inverse].to(torch.int32)
        with torch.no_grad():
            ref.weight.copy_(dense[:, inverse])
    rewrite_checkpoint(folder, tensors, {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                         "desc_act": act_order, "sym": False,
                                         "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    return reference.eval()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column AWQ puts in each nibble of a word


def write_awq(folder: Path, model: torch.nn.Module, group_size: int) -> torch.nn.Module:
    """AWQ (GEMM): qweight [in, out / 8] and qzeros [groups, out / 8] with output columns
    packed in AWQ_ORDER, scales [groups, out] fp16."""
    reference, tensors = copy.deepcopy(model), dict(model.state_dict())
    for (name, module), (_, ref) in zip(linears(model), linears(reference)):
        q, zeros, scales, dense = asymmetric_groups(module.weight.detach(), group_size)
        del tensors[f"{name}.weight"]
        tensors[f"{name}.qweight"] = pack_rows(q, order=AWQ_ORDER).T
        tensors[f"{name}.qzeros"] = pack_rows(zeros, order=AWQ_ORDER).T
        tensors[f"{name}.scales"] = scales.T.half()
        with torch.no_grad():
            ref.weight.copy_(dense)
    rewrite_checkpoint(folder, tensors, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "version": "gemm", "zero_point": True})
    return reference.eval()


def write_fp8_blocks(folder: Path, model: torch.nn.Module, block: tuple[int, int]) -> torch.nn.Module:
    """transformers' FineGrainedFP8: e4m3 weights, weight_scale_inv [out / b0, in / b1] that
    multiplies them back."""
    reference, tensors = copy.deepcopy(model), dict(model.state_dict())
    b0, b1 = block
    for (name, module), (_, ref) in zip(linears(model), linears(reference)):
        w = module.weight.detach()
        blocks = w.reshape(w.shape[0] // b0, b0, w.shape[1] // b1, b1)
        scale = blocks.abs().amax((1, 3)) / 448.0
        fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = fp8.reshape(w.shape)
        tensors[f"{name}.weight_scale_inv"] = scale
        with torch.no_grad():
            ref.weight.copy_((fp8.float() * scale[:, None, :, None]).reshape(w.shape))
    rewrite_checkpoint(folder, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)})
    return reference.eval()


WRITERS = {
    "gptq-g32": lambda folder, m: write_gptq(folder, m, 32, act_order=False),
    "gptq-g16-act-order": lambda folder, m: write_gptq(folder, m, 16, act_order=True),
    "gptq-v2-g32": lambda folder, m: write_gptq(folder, m, 32, act_order=False, v2=True),
    "awq-g32": lambda folder, m: write_awq(folder, m, 32),
    "fp8-blocks": lambda folder, m: write_fp8_blocks(folder, m, (32, 16)),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_gptq_awq_fp8_checkpoints(name, tiny_tokenizer_dir, tmp_path):
    folder = tmp_path / name
    reference = WRITERS[name](folder, tiny_llama(folder, tiny_tokenizer_dir))
    check_greedy_and_logprobs(load(folder, tmp_path), reference, prompts(), NEW_TOKENS)


def test_int8_quantization_on_top_of_a_prequantized_checkpoint(tiny_tokenizer_dir, tmp_path):
    folder = tmp_path / "gptq"
    write_gptq(folder, tiny_llama(folder, tiny_tokenizer_dir), 32, act_order=False)
    llm = LLM(folder, dtype="float32", num_kv_blocks=32, show_progress=False, quantization="int8")
    # the dequantized weights quantized again: still close to the reference's next token
    out = llm.generate([prompts()[0]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "4-bit GEMM layout"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ checkpoints of 3 bits"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "sparsity_config": {"format": "sparse-24"},
      "config_groups": {}}, "sparse compressed-tensors checkpoints"),
])
def test_unsupported_quantization_is_a_clear_error(config, message, tiny_tokenizer_dir, tmp_path):
    folder = tmp_path / "model"
    tiny_llama(folder, tiny_tokenizer_dir)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(folder, tmp_path)


def test_a_missing_part_is_named(tiny_tokenizer_dir, tmp_path):
    folder = tmp_path / "gptq"
    write_gptq(folder, tiny_llama(folder, tiny_tokenizer_dir), 32, act_order=False)
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj: cannot dequantize"):
        load(folder, tmp_path)
