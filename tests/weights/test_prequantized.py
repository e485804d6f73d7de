"""Pre-quantized checkpoints (weights/prequantized.py) in the GPTQ, AWQ, fp8 and fbgemm_fp8
formats, written from their layouts (tests/weights/prequantized_checkpoints.py), loaded by
tessera and checked against the model with the dequantized weights: greedy tokens and
log-probabilities (float32). Unsupported configs are clear errors."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from tessera import LLM, SamplingParams
from tessera.config import ConfigError
from tests.models.parity import check_greedy_and_logprobs
from tests.weights.prequantized_checkpoints import (NEW_TOKENS, load, pack_rows, prompts, tiny_llama, write_awq,
                                                    write_fp8_blocks, write_fp8_per_tensor, write_gptq)

pytestmark = pytest.mark.usefixtures("one_thread")


WRITERS = {
    "gptq-g32": lambda folder, m: write_gptq(folder, m, 32, act_order=False),
    "gptq-g16-act-order": lambda folder, m: write_gptq(folder, m, 16, act_order=True),
    "gptq-v2-g32": lambda folder, m: write_gptq(folder, m, 32, act_order=False, v2=True),
    "gptq-v2-by-format-key": lambda folder, m: write_gptq(folder, m, 32, act_order=False, v2=True,
                                                          format_key="format"),
    "gptq-8bit-sym": lambda folder, m: write_gptq(folder, m, 32, act_order=False, bits=8, symmetric=True),
    "gptq-2bit-channel": lambda folder, m: write_gptq(folder, m, 64, act_order=False, bits=2),
    "fp8-per-tensor": lambda folder, m: write_fp8_per_tensor(folder, m, "fp8"),
    "fbgemm-fp8": lambda folder, m: write_fp8_per_tensor(folder, m, "fbgemm_fp8"),
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
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "format": "gptq", "checkpoint_format": "gptq_v2"},
     "declares two formats"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"-:.*down_proj": {}}}, "`dynamic`"),
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


def test_gptq_v1_zero_points_that_borrowed_from_their_neighbour():
    """GPTQModel writes v1 zero points by subtracting 0x11111111 from each whole word, so a
    zero point of 0 borrows from the next slot; read back a slot at a time (+1 each) that
    would give 16 and a neighbour one too small."""
    from tessera.weights.prequantized import _gptq_weight

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (8, 64), generator=g)
    zeros = torch.randint(1, 16, (2, 8), generator=g)
    zeros[0, 0] = 0
    scales = torch.rand(2, 8, generator=g) + 0.1
    qzeros = pack_rows(zeros.T).T.to(torch.int64) - 0x11111111
    qzeros = torch.where(qzeros < -2 ** 31, qzeros + 2 ** 32, qzeros).to(torch.int32)
    parts = {"qweight": pack_rows(q.T), "qzeros": qzeros, "scales": scales, "g_idx": torch.arange(64) // 32}
    group = torch.arange(64) // 32
    want = (q - zeros.T[:, group]) * scales.T[:, group]
    torch.testing.assert_close(_gptq_weight(parts, 4, 32, v1_zeros=True), want)
