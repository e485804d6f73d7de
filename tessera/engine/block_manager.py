"""Allocation of fixed-size KV cache blocks to sequences.

A sequence's block table maps its token i to slot block_table[i // block_size] * block_size
+ i % block_size. Blocks are handed out from a free list and reference counted, so a block
can later be shared (prefix caching) without changing this interface.
"""
from __future__ import annotations

from collections import deque

from tessera.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        total = (num_tokens + self.block_size - 1) // self.block_size
        return max(total - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(need):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        stale = [b for b in seq.block_table if self.ref_counts[b] <= 0]
        if stale:  # checked before touching anything, so a bad call corrupts nothing
            raise RuntimeError(f"blocks {stale} freed more often than allocated")
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def all_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks and not any(self.ref_counts)
