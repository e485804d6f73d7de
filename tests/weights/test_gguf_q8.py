"""A GGUF stored as Q8_0 runs in int8 on CPU with --quantization unset, in the CPU kernel's
groups of 32 (tessera/ops/linear_int8.py): the layers hold the file's codes and steps (bar a
few codes one off, where bf16's rounding of the loaded values moved them), and the model
answers as transformers on the file's values does."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tessera.ops.cpu.linear_int8 import kernel_unavailable, unpack_int8
from tessera.sampling.params import SamplingParams
from tests.weights.gguf_writer import write_llama_gguf
from tests.weights.test_gguf import INTER, expected_weights, tiny_llama

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tiny model: see conftest
              pytest.mark.skipif(bool(kernel_unavailable()), reason="; ".join(kernel_unavailable()) or "-")]


def q8_0_parts(reader: gguf.GGUFReader, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [n, k], steps float16 [n, k / 32]) of a Q8_0 tensor as stored."""
    tensor = next(t for t in reader.tensors if t.name == name)
    assert tensor.tensor_type == QT.Q8_0
    n = int(tensor.shape[1])
    blocks = np.asarray(tensor.data).reshape(n, -1, 34)
    steps = torch.from_numpy(blocks[..., :2].copy().view(np.float16)).squeeze(-1)
    return torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, -1), steps


def test_a_q8_0_file_runs_in_int8_on_its_codes(make_tiny_llama, tiny_tokenizer_dir, tmp_path: Path):
    hf = tiny_llama(make_tiny_llama, seed=4)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", QT.Q8_0)
    prompt = [5, 9, 14, 3, 77, 120]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    with LLM(path, dtype="bfloat16", num_kv_blocks=16, show_progress=False, cache_dir=tmp_path / "cache") as llm:
        assert llm.engine.quantization == "int8"
        down = llm.engine.model.model.layers[1].mlp.down_proj.weight
        assert down.dtype == torch.int8
        codes, steps, scale = unpack_int8(down, INTER)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    want_codes, want_steps = q8_0_parts(gguf.GGUFReader(str(path)), "blk.1.ffn_down.weight")
    off = (codes.int() - want_codes.int()).abs()
    assert off.max() <= 1 and off.float().mean() < 0.01
    assert torch.allclose(steps.float() * scale.unsqueeze(1), want_steps.float(), rtol=2 ** -8, atol=0)

    file_values = expected_weights(hf, QT.Q8_0)
    with torch.no_grad():  # transformers on the file's values
        for name, p in hf.named_parameters():
            p.copy_(file_values[name])
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    assert out.token_ids[0] == int(reference.argmax())
    for token_id, logprob in out.logprobs[0].items():
        assert abs(logprob.logprob - reference[token_id].item()) <= 0.05, token_id
