"""llama.cpp's files of Mamba-2 hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1) and the
Gated DeltaNet's (Qwen3.5): their `ssm.*` keys, their tensors as the converter stores them,
and what a test checks once such a file is loaded (gguf_writer.py writes the rest)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tests.models.parity import check_greedy_alone_and_batched, check_prefill_and_decode_logits
from tests.weights.gguf_writer import llama_cpp_permute, round_tripped


def add_ssm_keys(w: gguf.GGUFWriter, *, conv_kernel: int, state: int, groups: int, inner: int, heads: int) -> None:
    """The `ssm.*` sizes llama.cpp's recurrent layers read (Mamba-2's, the Gated DeltaNet's)."""
    w.add_ssm_conv_kernel(conv_kernel)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)


def llama_cpp_hybrid_tensor(name: str, t: torch.Tensor, cfg, groups: int) -> torch.Tensor:
    """A Mamba-2 hybrid's checkpoint tensor as llama.cpp's converter stores it (by its name:
    the mixer `mamba` or `mixer`): the conv squeezed, -exp(A_log) and D as [heads, 1], the
    gated norm as [groups, inner / groups], Q / K rows permuted as Llama's; others as they are."""
    if name.endswith("conv1d.weight"):
        return t.squeeze(1)
    if name.endswith(".A_log"):
        return -torch.exp(t).reshape(-1, 1)
    if name.endswith(".D"):
        return t.reshape(-1, 1)
    if name.endswith(("mamba.norm.weight", "mixer.norm.weight")):
        return t.reshape(groups, -1)
    if name.endswith("q_proj.weight"):
        return torch.from_numpy(llama_cpp_permute(t.numpy(), cfg.num_attention_heads))
    if name.endswith("k_proj.weight"):
        return torch.from_numpy(llama_cpp_permute(t.numpy(), cfg.num_key_value_heads))
    return t


def assert_mamba2_vectors_back(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """A Mamba-2 mixer loaded from a file holds the checkpoint's A_log, D, gated norm and
    dt_bias (llama.cpp stores -exp(A_log) and reshapes the others; a tiny model's logits
    barely feel A, so it is checked here)."""
    pairs = [(ours.A_log, theirs.A_log), (ours.D, theirs.D), (ours.dt_bias, theirs.dt_bias)]
    if ours.norm_weight is not None or hasattr(theirs.norm, "weight"):  # (a mixer without its norm: Falcon-H1's)
        pairs.append((ours.norm_weight, theirs.norm.weight))
    for mine, original in pairs:
        torch.testing.assert_close(mine.float(), original.float(), rtol=1e-6, atol=1e-6)


@contextmanager
def loaded_hybrid(path: Path, cache_dir: Path) -> Iterator[LLM]:
    """The file's model in float32, without prefix caching (which cuts a hybrid's prompts at
    block boundaries: the logit check counts steps)."""
    with LLM(path, dtype="float32", num_kv_blocks=64, show_progress=False, cache_dir=cache_dir,
             enable_prefix_caching=False) as llm:
        yield llm


def check_equals_reference(llm: LLM, model: torch.nn.Module, qtype: QT, stored: Callable[[str, np.ndarray], bool],
                           name: str, monkeypatch) -> None:
    """Every logit of prefill and decode steps (a tiny model's greedy tokens hide much), then
    tokens alone and batched, against `model` holding what a `qtype` file stores."""
    reference = round_tripped(model, qtype, stored)
    check_prefill_and_decode_logits(llm, reference, name, monkeypatch)
    check_greedy_alone_and_batched(llm, reference, (5, 23))
