"""Allocation of fixed-size KV cache blocks to sequences, with prefix caching.

A sequence's block table maps its token i to slot block_table[i // block_size] * block_size
+ i % block_size. Blocks are reference counted. With prefix caching, every full block is
identified by a hash chained over the previous block's hash and its own token ids; a new
sequence reuses the cached blocks of its longest cached prefix. Freed blocks keep their
contents and hash and are evicted least-recently-freed first, only when a block is needed.
Hash hits are confirmed by comparing the parent hash and the token ids, so a collision can
never mix sequences. The first block's parent is the sequence's cache salt (its LoRA
adapter, or None), so KV computed under one adapter is never reused under another. A block
holding image placeholder tokens also hashes the images' pixels: the placeholder ids are
the same for every image.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tessera.engine.sequence import Sequence


def chain_hash(parent: int | None, key: tuple) -> int:
    """A block's hash from its parent's and its key (Sequence.block_key: its token ids,
    with the content hashes of images it holds placeholders of)."""
    return hash((parent, key))


@dataclass
class PrefixMatch:
    """Cached blocks found for a sequence's prefix (not yet taken)."""

    blocks: list[int]
    hashes: list[int]
    num_free: int  # how many of them sit in the free queue (taking them uses free capacity)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (oldest first); cached ones keep their hash entry.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        # what each cached block's hash was computed from: (parent hash or salt, token ids)
        self.block_tokens: list[tuple | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0     # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(self.num_blocks_for(num_tokens) - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        stale = [b for b in seq.block_table if self.ref_counts[b] <= 0]
        if stale:  # checked before touching anything, so a bad call corrupts nothing
            raise RuntimeError(f"blocks {stale} freed more often than allocated")
        # Tail first: the end of a sequence is the least likely to be shared, so it is
        # evicted before the prefix blocks.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.block_hashes = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s blocks past its first `num_tokens` tokens (blocks that rejected
        speculative drafts were given: never hashed, never shared). They go to the front
        of the free queue, so the next allocation takes them before evicting a cached
        prefix."""
        keep = max(self.num_blocks_for(num_tokens), len(seq.block_hashes))
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                self.free_blocks.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (a beam forked from the sequence holding them)."""
        for block in blocks:
            self.ref_counts[block] += 1

    def is_shared(self, block: int) -> bool:
        return self.ref_counts[block] > 1

    def unshare(self, seq: Sequence, index: int) -> tuple[int, int] | None:
        """Give `seq` a block of its own in place of its shared block `index`, before it
        writes there (copy-on-write): (the shared block, the new one) for the caller to copy
        the contents; None when no block is free."""
        if not self.free_blocks:
            return None
        shared = seq.block_table[index]
        fresh = self._take_free_block()
        self.ref_counts[shared] -= 1
        seq.block_table[index] = fresh
        return shared, fresh

    def all_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks and not any(self.ref_counts)

    # --- prefix caching -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached blocks of `seq`'s longest cached prefix, leaving at least its last
        token to compute (its logits are needed). Looking has no side effects."""
        match = PrefixMatch([], [], 0)
        if not self.enable_prefix_caching or seq.block_table:
            return match
        usable = (seq.num_tokens - 1) // self.block_size
        parent = seq.cache_salt
        for i in range(usable):
            tokens = seq.block_key(i, self.block_size)
            h = chain_hash(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != (parent, tokens):
                break
            match.blocks.append(block)
            match.hashes.append(h)
            match.num_free += self.ref_counts[block] == 0
            parent = h
        return match

    def take_prefix(self, seq: Sequence, match: PrefixMatch) -> int:
        """Give `seq` the matched blocks; returns how many tokens they already hold.
        Every admission passes here, so this is where the hit statistics are counted."""
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(match.blocks) * self.block_size
        for block in match.blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.block_hashes = list(match.hashes)
        return len(match.blocks) * self.block_size

    def reset_prefix_cache(self) -> int:
        """Forget what every free block holds, so no later prompt reuses it (benchmarks that
        repeat prompts); blocks sequences hold keep theirs. Returns how many were forgotten."""
        forgotten = 0
        for block in self.free_blocks:
            h = self.block_hash[block]
            if h is None:
                continue
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = self.block_tokens[block] = None
            forgotten += 1
        return forgotten

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq` has completely computed since the last call."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
        for i in range(len(seq.block_hashes), full):
            tokens = seq.block_key(i, self.block_size)
            h = chain_hash(parent, tokens)
            block = seq.block_table[i]
            if h not in self.cached:  # a twin computed concurrently keeps the entry
                self.cached[h] = block
                self.block_hash[block], self.block_tokens[block] = h, (parent, tokens)
            seq.block_hashes.append(h)
            parent = h
