"""Pre-quantized checkpoints of a tiny Llama, written the way each tool writes them, with
the reference model holding the dequantized weights (tests/weights/test_prequantized.py,
test_compressed_tensors.py).

- compressed-tensors: written by the compressed-tensors library itself (as llm-compressor
  does); the reference weights are the library's own quantize-dequantize.
- GPTQ, AWQ, fp8 (blocks, per tensor) and fbgemm_fp8: written here from the formats'
  published layouts (GPTQ: input rows packed into int32 words, v1 zero points stored minus
  one as GPTQModel does; AWQ: output columns packed in its interleaved nibble order).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera import LLM
from tests.models.parity import make_tiny, prompt_ids

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


def legacy_padded_pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Older compressed-tensors packing: 32 // bits unsigned (value + offset) slots per word."""
    per_word, offset = 32 // bits, 1 << (bits - 1)
    v = (values.to(torch.int64) + offset).movedim(dim, -1)
    pad = -v.shape[-1] % per_word
    v = torch.nn.functional.pad(v, (0, pad)).reshape(*v.shape[:-1], -1, per_word)
    words = sum(v[..., k] << (bits * k) for k in range(per_word))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).movedim(-1, dim).contiguous()


# --- formats written here from their layouts --------------------------------------------

def asymmetric_groups(w: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = False):
    """Per-group unsigned quantization of an [out, in] weight: q [out, in], zero points and
    fp16-representable scales [out, groups], and the dequantized weight (symmetric: every
    zero point at the middle, 2 ** (bits - 1))."""
    out, cols = w.shape
    grouped = w.reshape(out, cols // group_size, group_size)
    top = 2 ** bits - 1
    if symmetric:
        scales = (grouped.abs().amax(2) / (top // 2)).clamp(min=1e-8).half().float()
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        lo, hi = grouped.amin(2).clamp(max=0), grouped.amax(2).clamp(min=0)
        scales = ((hi - lo) / top).clamp(min=1e-8).half().float()
        zeros = torch.round(-lo / scales).clamp(0, top)
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


def write_gptq(folder: Path, model: torch.nn.Module, group_size: int, act_order: bool, v2: bool = False,
               bits: int = 4, symmetric: bool = False, format_key: str = "checkpoint_format") -> torch.nn.Module:
    """GPTQ: qweight [in * bits / 32, out] (input rows packed), qzeros [groups, out * bits / 32],
    scales [groups, out] fp16, g_idx [in] (a column's group: permuted with act-order). The v1
    format stores zero points minus one, taken from the whole word as GPTQModel writes them,
    so a zero point of 0 borrows from its neighbour: one group per weight is made all
    positive to have one."""
    reference, tensors = copy.deepcopy(model), dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    ones = sum(1 << (bits * k) for k in range(32 // bits))
    for (name, module), (_, ref) in zip(linears(model), linears(reference)):
        w = module.weight.detach().clone()
        w[0, :group_size] = w[0, :group_size].abs()  # its zero point is 0 (asymmetric)
        cols = w.shape[1]
        perm = torch.randperm(cols, generator=g) if act_order else torch.arange(cols)
        q, zeros, scales, dense = asymmetric_groups(w[:, perm], group_size, bits, symmetric)
        inverse = torch.argsort(perm)  # back to the checkpoint's column order
        qzeros = pack_rows(zeros, bits).T.to(torch.int64)
        if not v2:
            qzeros = (qzeros - ones) & 0xFFFFFFFF
            qzeros = torch.where(qzeros >= 2 ** 31, qzeros - 2 ** 32, qzeros)
        del tensors[f"{name}.weight"]
        tensors[f"{name}.qweight"] = pack_rows(q[:, inverse].T, bits)
        tensors[f"{name}.qzeros"] = qzeros.to(torch.int32)
        tensors[f"{name}.scales"] = scales.T.half()
        tensors[f"{name}.g_idx"] = (torch.arange(cols) // group_size)[inverse].to(torch.int32)
        with torch.no_grad():
            ref.weight.copy_(dense[:, inverse])
    rewrite_checkpoint(folder, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": act_order, "sym": symmetric,
                                         format_key: "gptq_v2" if v2 else "gptq"})
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


def write_fp8_per_tensor(folder: Path, model: torch.nn.Module, method: str) -> torch.nn.Module:
    """AutoFP8's "fp8" (one weight_scale per tensor, a static input_scale) or Meta's
    "fbgemm_fp8" (a weight_scale per output row)."""
    reference, tensors = copy.deepcopy(model), dict(model.state_dict())
    for (name, module), (_, ref) in zip(linears(model), linears(reference)):
        w = module.weight.detach()
        scale = (w.abs().amax(1, keepdim=True) if method == "fbgemm_fp8" else w.abs().amax().reshape(1)) / 448.0
        fp8 = (w / (scale if method == "fbgemm_fp8" else scale[0])).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = fp8
        tensors[f"{name}.weight_scale"] = scale
        tensors[f"{name}.input_scale" if method == "fp8" else f"{name}.input_scale_ub"] = torch.tensor([0.5])
        with torch.no_grad():
            ref.weight.copy_(fp8.float() * scale)
    config = ({"quant_method": "fp8", "activation_scheme": "static"} if method == "fp8"
              else {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})
    rewrite_checkpoint(folder, tensors, config)
    return reference.eval()
