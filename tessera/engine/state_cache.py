"""Prefix caching for models with recurrent layers: snapshots of a sequence's state at block
boundaries, kept in slots of their own beside the running sequences' slots.

A cached prefix of KV blocks is only usable with the recurrent state at its end, so a
snapshot is keyed by the hash of the block it ends with (the block manager's chained hash:
the tokens, images and adapter of everything before). The scheduler
- cuts a prefill chunk at the last block boundary before the prompt's end, so the state
  there exists at the end of a step, and has it copied into a snapshot slot after that step
  (and likewise whenever a decode reaches a boundary: the next turn of a conversation
  starts with the previous one);
- on admission, takes the longest cached prefix that ends where a snapshot does, and has
  the snapshot copied into the sequence's own slot before its first step.
Copies run on the device in step order (restores before the step's forward, saves after),
and a snapshot becomes visible to admissions only once its step is done, so a restore
never reads a snapshot its step has not written yet.

Snapshots are evicted least recently used, with one exception: a snapshot of decoding
(past the prompt) never evicts one of a prompt, which other requests may share (a system
prompt); and each sequence keeps at most one snapshot of its decoding (its latest
boundary), so decoding sequences only displace each other's."""
from __future__ import annotations

from collections import OrderedDict


class StateCache:
    def __init__(self, first_slot: int, num_slots: int):
        self.num_slots = num_slots
        self.free: list[int] = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recent first
        self.decoding: set[int] = set()  # the hashes of snapshots taken past a prompt

    def lookup(self, block_hash: int) -> int | None:
        """The snapshot slot of the state after the block `block_hash` (marked recently used)."""
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            self.by_hash.move_to_end(block_hash)
        return slot

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.by_hash

    def take(self, decoding: bool = False) -> int | None:
        """A slot to save a snapshot into: a free one, else the least recently used one's
        (forgotten now; for a snapshot of `decoding`, only another such). None when there
        is none to give."""
        if self.free:
            return self.free.pop()
        victim = next((h for h in self.by_hash if not decoding or h in self.decoding), None)
        if victim is None:
            return None
        self.decoding.discard(victim)
        return self.by_hash.pop(victim)

    def register(self, block_hash: int, slot: int, decoding: bool = False) -> bool:
        """Make a saved snapshot findable; False (the slot is given back) when one for this
        block exists already."""
        if block_hash in self.by_hash:
            self.free.append(slot)
            return False
        self.by_hash[block_hash] = slot
        if decoding:
            self.decoding.add(block_hash)
        return True

    def release(self, slot: int) -> None:
        """Give back a slot taken for a snapshot that will not be registered."""
        self.free.append(slot)

    def forget(self, block_hash: int) -> None:
        self.decoding.discard(block_hash)
        slot = self.by_hash.pop(block_hash, None)
        if slot is not None:
            self.free.append(slot)

    def reset(self) -> int:
        """Forget every snapshot; returns how many."""
        count = len(self.by_hash)
        for block_hash in list(self.by_hash):
            self.forget(block_hash)
        return count


def num_state_slots(max_num_seqs: int, prefix_caching: bool) -> int:
    """State slots a model with recurrent layers gets: one per running sequence, and with
    prefix caching as many again for snapshots."""
    return max_num_seqs * (2 if prefix_caching else 1)
