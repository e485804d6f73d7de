"""The two builds of a compact-weight GEMM (linear_int8, linear_int4): the AVX512 one, and on
CPUs with AMX the AMX one (its widened rows on tiles); a test's `build` fixture runs on each.
And x as their 8-bit tiles round it (AVX512-VNNI builds)."""
from __future__ import annotations

from types import ModuleType

import pytest
import torch


def avx512_or_amx(request, monkeypatch, module: ModuleType) -> str:
    """request.param "amx": `module`'s AMX build (skipped where none runs); "avx512": the
    AVX512 build on every host."""
    if request.param == "amx":
        if module.amx_kernel() is None:
            pytest.skip("no AMX, or its build does not compile")
    else:
        monkeypatch.setattr(module, "amx_kernel", lambda *exact: None)
    return request.param


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] bf16 as the 8-bit x tiles multiply it (ops/cpu/int8_rows.h), in double: per
    group of 32 the codes rint(x / d), d = max |x| / 127, each step in float32 as there."""
    groups = x.float().view(x.shape[0], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = (groups * inverse).clamp(-127, 127).round()
    return (codes.double() * d.double()).view(x.shape)


def step_metadata(query_lens: list[int]):
    """A step's attention metadata with these query lengths, for ops that look at the step's
    kind (one token per sequence or not); nothing in it is read otherwise."""
    from tessera.ops.attention.metadata import AttentionMetadata

    seqs, rows = len(query_lens), sum(query_lens)
    decodes = next((i for i, q in enumerate(query_lens) if q != 1), seqs)
    return AttentionMetadata(slot_mapping=torch.full((rows,), -1), block_tables=torch.zeros(seqs, 1, dtype=torch.int32),
                             seq_lens=torch.tensor(query_lens, dtype=torch.int32),
                             query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                                          dtype=torch.int32),
                             num_decodes=decodes, num_decode_tokens=decodes, seq_lens_list=list(query_lens),
                             query_lens_list=list(query_lens))
