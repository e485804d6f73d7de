"""compressed-tensors checkpoints (weights/prequantized.py), written by the library itself
(tests/weights/prequantized_checkpoints.py): every scheme matches the library's own
dequantized weights, the schemes transformers loads match its loading too, and the
library's packing, group index, older padded packing and target matching are read as it
reads them."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from tests.models.parity import check_greedy_and_logprobs
from tests.weights.prequantized_checkpoints import (CT_SCHEMES, NEW_TOKENS, legacy_padded_pack, load, prompts,
                                                    tiny_llama, write_compressed_tensors)

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_int32_inverts_compressed_tensors_packing(bits, dim):
    """Every width, both directions: the library's dense packing (values straddle words at
    3, 5, 6, 7 bits), with a length that leaves the last word part-filled."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tessera.weights.dequantize import unpack_int32

    g = torch.Generator().manual_seed(bits)
    shape = (37, 6) if dim == 0 else (6, 37)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, generator=g, dtype=torch.int8)
    packed = pack_to_int32(values, bits, packed_dim=dim)
    unpacked = unpack_int32(packed, bits, shape[dim], dim) - (1 << (bits - 1))
    assert torch.equal(unpacked.to(torch.int8), values)


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_checkpoints(scheme, tiny_tokenizer_dir, tmp_path):
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
    from transformers import AutoModelForCausalLM

    fmt, args = CT_SCHEMES[scheme]
    folder = tmp_path / scheme
    write_compressed_tensors(folder, tiny_llama(folder, tiny_tokenizer_dir), fmt, args)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    check_greedy_and_logprobs(load(folder, tmp_path), hf, prompts(), NEW_TOKENS)


def test_compressed_tensors_older_padded_packing(tiny_tokenizer_dir, tmp_path):
    """3-bit checkpoints written before compressed-tensors packed densely: 10 values to a word."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    args = dict(num_bits=3, type="int", strategy="group", group_size=32, symmetric=False)
    folder = tmp_path / "padded"
    reference = write_compressed_tensors(folder, tiny_llama(folder, tiny_tokenizer_dir), "pack-quantized", args)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        shape = torch.Size(tensors[name.replace("weight_packed", "weight_shape")].tolist())
        tensors[name] = legacy_padded_pack(unpack_from_int32(tensors[name], 3, shape), 3, dim=1)
        zp = name.replace("weight_packed", "weight_zero_point")
        zp_shape = torch.Size([shape[0], tensors[name.replace("weight_packed", "weight_scale")].shape[1]])
        tensors[zp] = legacy_padded_pack(unpack_from_int32(tensors[zp], 3, zp_shape, packed_dim=0), 3, dim=0)
    save_file(tensors, str(folder / "model.safetensors"))
    check_greedy_and_logprobs(load(folder, tmp_path), reference, prompts(), NEW_TOKENS)


def test_compressed_tensors_groups_are_matched_as_the_library_matches_them(tiny_tokenizer_dir, tmp_path):
    """Overlapping `re:` targets: the library takes the first pattern in sorted order (here
    `re:.*down_proj`, 8-bit, over the earlier group's `re:.*mlp.*`, 4-bit)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    folder = tmp_path / "overlap"
    model = tiny_llama(folder, tiny_tokenizer_dir)
    reference = copy.deepcopy(model)
    four, eight = (QuantizationArgs(num_bits=b, type="int", strategy="group", group_size=16) for b in (4, 8))
    apply_quantization_config(model, QuantizationConfig(config_groups={
        "group_0": QuantizationScheme(targets=["re:.*mlp.*"], weights=four),
        "group_1": QuantizationScheme(targets=["re:.*down_proj"], weights=eight)}, ignore=["lm_head"]))
    references = dict(reference.named_modules())
    seen = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            args, w = scheme.weights, module.weight
            seen.add((name.rsplit(".", 1)[-1], args.num_bits))
            grouped = w.reshape(w.shape[0], -1, args.group_size)
            scale, zero = calculate_qparams(grouped.amin(2), grouped.amax(2), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
            references[name].weight.copy_(fake_quantize(w, module.weight_scale, module.weight_zero_point, args))
    assert ("down_proj", 8) in seen and ("up_proj", 4) in seen
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    check_greedy_and_logprobs(load(folder, tmp_path), reference.eval(), prompts(), NEW_TOKENS)
