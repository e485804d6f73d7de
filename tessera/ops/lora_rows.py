"""`lora_rows`: add each row's LoRA delta, every row with its own adapter slot (or none).

out[r] += (x[r] @ A[s].T) @ B[s].T with s = row_slots[r]; rows with s < 0 are the base
model's. Used for decode-sized steps (tessera/lora/layer.py), where one call per layer with
the slots in a tensor is what a captured decode graph can replay. The reference runs every
row through every slot's A (one GEMM, K = in), zeroes what is not the row's own slot, and
expands through all slots' B at once (one GEMM, K = slots x capacity): no gathered copies
of the factors, no host sync, and for a few rows a little more arithmetic than needed.
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
    slots, capacity, _ = a.shape
    rows = x.shape[0]
    t = (x @ a.reshape(slots * capacity, -1).t()).view(rows, slots, capacity)
    own = row_slots.unsqueeze(1) == torch.arange(slots, device=row_slots.device)  # -1: no slot
    # selected, not multiplied: another slot's overflow (inf x 0 = NaN) must not leak in;
    # B holds only finite values (load_adapter refuses others), so the expansion is clean
    t = torch.where(own.unsqueeze(2), t, torch.zeros((), dtype=t.dtype, device=t.device))
    out += t.reshape(rows, slots * capacity) @ b_t.reshape(slots * capacity, -1)
