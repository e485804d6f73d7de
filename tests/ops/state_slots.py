"""What the recurrent-state kernels' tests share: decode steps on a state pool whose slots
are scattered (not consecutive, not in order), checked against the torch builder step by
step, every other slot left as it was."""
from __future__ import annotations

from typing import Callable

import torch


def check_steps_on_scattered_slots(state: torch.Tensor, batch: int, gen: torch.Generator,
                                   step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
                                   rtol: float, atol: float, steps: int = 3) -> None:
    """`step(state, want_state, slots)` runs one step of the kernel on `state` and of the
    reference on `want_state` (and checks their outputs); after each, the states agree
    within rtol / atol, the updated state feeding the next step."""
    slots = torch.randperm(state.shape[0], generator=gen)[:batch]  # not consecutive, not in order
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[slots] = False
    before = state.clone()
    want_state = state.clone()
    for _ in range(steps):
        step(state, want_state, slots)
        torch.testing.assert_close(state, want_state, rtol=rtol, atol=atol)
    assert torch.equal(state[untouched], before[untouched])
