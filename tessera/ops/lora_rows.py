"""`lora_rows`: add each row's LoRA delta, every row with its own adapter slot (or none).

out[r] += (x[r] @ A[s].T) @ B[s].T with s = row_slots[r]; rows with s < 0 are the base
model's. Used for decode-sized steps (tessera/lora/layer.py), where one call per layer with
the slots in a tensor is what a captured decode graph can replay. The reference gathers
each row's factors: fine for a few rows (the memory is rows x capacity x in), not for a
prefill, which runs per segment instead.
"""
from __future__ import annotations

import torch

from tessera.ops.registry import register_op


@register_op("lora_rows", name="torch_lora_rows", priority=0)
def lora_rows_ref(x: torch.Tensor, out: torch.Tensor, row_slots: torch.Tensor, slot_ranks: torch.Tensor,
                  a: torch.Tensor, b_t: torch.Tensor) -> None:
    """x [rows, in], out [rows, n] (added to in place), row_slots [rows] int32, slot_ranks
    [slots] int32 (unused here: A and B are zero past each slot's rank), a [slots, cap,
    in], b_t [slots, cap, n]."""
    index = row_slots.clamp(min=0).long()
    t = torch.bmm(a.index_select(0, index), x.unsqueeze(2)).squeeze(2)       # [rows, cap]
    t = t * (row_slots >= 0).unsqueeze(1).to(t.dtype)                        # base rows: 0
    out += torch.bmm(t.unsqueeze(1), b_t.index_select(0, index)).squeeze(1)  # [rows, n]
