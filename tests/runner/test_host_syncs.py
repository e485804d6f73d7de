"""HostSyncRecorder, which decides before a CUDA graph capture whether the decode pass can be
captured: it names the ops that read device values on the host or size outputs from data,
and nothing else. A tiny Llama's whole forward pass records nothing (its CUDA graphs stay
on); a Mixtral's records its expert grouping (its decode runs eagerly, with that said)."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.runner.host_syncs import HostSyncRecorder
from tests.models.test_moe_parity import make_tiny_moe

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.inference_mode()
def test_records_the_ops_that_wait_on_the_host_and_only_those():
    x = torch.randn(4, 8)
    with HostSyncRecorder() as quiet:
        y = torch.softmax(x @ x.T, dim=-1)
        y.view(-1)[:5].clone()
        x.index_select(0, torch.tensor([0, 2]))
        x[torch.tensor([1, 3])]  # integer indices: the output size is known
        torch.repeat_interleave(x, 2, dim=0)
        x.to(torch.bfloat16)
    assert quiet.ops == []
    with HostSyncRecorder() as loud:
        x.sum().item()
        torch.nonzero(x > 0)
        x[x > 0]                      # a boolean mask
        torch.bincount(torch.tensor([1, 2, 2]))
        x.unique()
        torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1]), dim=0)  # repeats read from data
        x.sum().item()                # named once
    assert loud.ops == ["aten.item", "aten.nonzero", "aten.index", "aten.bincount", "aten._unique2",
                        "aten.repeat_interleave"]


def _forward_ops(llm: LLM) -> list[str]:
    """What the model's forward passes record over a prefill and a few decode steps (the
    engine's own host work, sampling and scheduling, is outside them)."""
    model = llm.engine.model
    recorded: list[str] = []
    original = model.forward

    def recording_forward(*args, **kwargs):
        with HostSyncRecorder() as syncs:
            out = original(*args, **kwargs)
        recorded.extend(op for op in syncs.ops if op not in recorded)
        return out

    model.forward = recording_forward
    try:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        del model.forward
    return recorded


def test_a_llama_forward_pass_never_syncs_with_the_host(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=2)
    with LLM(folder, dtype="float32", num_kv_blocks=32, enforce_eager=True, show_progress=False) as llm:
        assert _forward_ops(llm) == []


def test_a_mixture_of_experts_forward_pass_is_named(tmp_path, tiny_tokenizer_dir):
    make_tiny_moe(tmp_path, tiny_tokenizer_dir, "mixtral", num_local_experts=4, intermediate_size=96)
    with LLM(tmp_path, dtype="float32", num_kv_blocks=32, enforce_eager=True, show_progress=False) as llm:
        assert "aten.bincount" in _forward_ops(llm)
