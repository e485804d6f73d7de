"""Triton kernels (CUDA builders) against the pure-torch ops through Triton's interpreter on
CPU: kv_write with padded slots, paged decode with GQA/MHA, odd head sizes, block sizes 4
and 16, windows, soft-capping, multi-partition merges and partitions a captured graph leaves
empty, and varlen prefill chunks over prefix-cached context (causal by absolute position)
with windows and soft-capping. Then the whole engine with every Triton builder in place,
through the interpreter, against transformers. Skipped without triton; on a GPU machine the
kernel cases also run on the device."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.ops.registry import OpSpec, select_op

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def run_cases(device: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    return subprocess.run([sys.executable, "-m", "tests.ops.triton_cases", device], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@needs_triton
def test_kernels_match_torch_under_the_interpreter():
    result = run_cases("cpu", interpret=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton kernels OK" in result.stdout


@needs_triton
def test_engine_through_interpreted_triton_kernels_matches_transformers(tmp_path, tiny_tokenizer_dir):
    """The engine as a CUDA run drives it (every Triton builder, its metadata, mixed
    prefill/decode steps, chunked prefill, prefix-cache hits), on CPU through the
    interpreter: transformers' greedy tokens, token and prompt logprobs in float32, for GQA
    Llama and Gemma-2 (soft-capping, sliding window on alternate layers, GELU); and each
    decode-only step again as a captured CUDA graph would replay it, padded to its bucket
    (tests/ops/triton_engine_case.py)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.models.parity import make_tiny
    from tests.models.test_gemma2_parity import BASE as GEMMA2_BASE

    folders = []
    for name, config, model, extra in (("llama", LlamaConfig, LlamaForCausalLM, {}),
                                       ("gemma2", Gemma2Config, Gemma2ForCausalLM,
                                        dict(base=GEMMA2_BASE, attn_implementation="eager"))):
        folders.append(tmp_path / name)
        make_tiny(folders[-1], tiny_tokenizer_dir, config, model, seed=3, **extra)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "tests.ops.triton_engine_case", *map(str, folders)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "engine through triton OK" in result.stdout


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_match_torch_on_the_gpu():
    result = run_cases("cuda", interpret=False)
    assert result.returncode == 0, result.stderr[-3000:]


def test_cuda_lookups_choose_triton_or_say_why():
    choice = select_op(OpSpec("paged_attention", "cuda", torch.bfloat16, phase="decode"))
    if importlib.util.find_spec("triton") is None:
        assert choice.builder.name == "torch_paged_decode"
        assert ("triton_paged_decode", ("triton is not installed (pip install triton)",)) in choice.rejected
    else:
        assert choice.builder.name == "triton_paged_decode"
    prefill = select_op(OpSpec("paged_attention", "cuda", torch.bfloat16, phase="prefill"))
    want = "torch_paged_prefill" if importlib.util.find_spec("triton") is None else "triton_paged_prefill"
    assert prefill.builder.name == want
    for kind, name in (("rms_norm", "triton_rms_norm"), ("silu_and_mul", "triton_silu_and_mul"),
                       ("gelu_tanh_and_mul", "triton_gelu_tanh_and_mul"), ("rotary", "triton_rotary")):
        choice = select_op(OpSpec(kind, "cuda", torch.bfloat16))
        assert choice.builder.name == (name if importlib.util.find_spec("triton") else f"torch_{kind}"), kind
    # CPU lookups never consider the CUDA builders
    cpu = select_op(OpSpec("kv_write", "cpu", torch.float32))
    assert cpu.builder.name in ("cpu_kv_write", "torch_kv_write")
    assert any(name == "triton_kv_write" and "device cpu" in " ".join(r) for name, r in cpu.rejected)
