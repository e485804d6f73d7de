"""BlockManager: blocks handed out once, counted once, and all back after everything is freed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.engine.block_manager import BlockManager
from tessera.engine.sequence import Sequence
from tessera.sampling.params import SamplingParams


def make_seq(request_id: str = "r", num_tokens: int = 1) -> Sequence:
    return Sequence(request_id, None, list(range(3, 3 + num_tokens)), SamplingParams(), 10_000)


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    owned = [b for s in seqs for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is in two block tables"
    assert len(bm.free_blocks) == len(set(bm.free_blocks)), "a block is twice on the free list"
    assert not set(owned) & set(bm.free_blocks), "an owned block is also on the free list"
    assert len(owned) + bm.num_free_blocks == bm.num_blocks, "a block leaked"
    for block in range(bm.num_blocks):
        expected = 1 if block in owned else 0
        assert bm.ref_counts[block] == expected, f"block {block}: ref count {bm.ref_counts[block]}"
    assert bm.usage == pytest.approx(len(owned) / bm.num_blocks)


def test_allocate_gives_each_token_a_slot_and_only_what_is_missing():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq()
    assert bm.blocks_needed(seq, 1) == 1
    assert bm.blocks_needed(seq, 4) == 1
    assert bm.blocks_needed(seq, 5) == 2
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    assert bm.num_free_blocks == 6
    # Growing within the last block needs nothing; crossing into the next needs one more.
    assert bm.blocks_needed(seq, 8) == 0
    bm.allocate(seq, 8)
    assert len(seq.block_table) == 2
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    # Asking for fewer tokens than already covered never shrinks or allocates.
    assert bm.blocks_needed(seq, 2) == 0
    check_invariants(bm, [seq])


def test_allocate_beyond_capacity_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 8)
    assert not bm.can_allocate(b, 5)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 5)
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    check_invariants(bm, [a, b])
    assert bm.can_allocate(b, 4)


def test_free_returns_blocks_and_all_free_after_freeing_everything():
    bm = BlockManager(num_blocks=10, block_size=2)
    seqs = [make_seq(str(i)) for i in range(4)]
    for i, s in enumerate(seqs):
        bm.allocate(s, 2 * i + 1)
    assert not bm.all_free()
    check_invariants(bm, seqs)
    bm.free(seqs[1])
    assert seqs[1].block_table == []
    check_invariants(bm, seqs)
    for s in seqs:
        bm.free(s)
    assert bm.all_free()
    assert bm.num_free_blocks == 10
    assert bm.usage == 0.0
    # Freed blocks are reusable: the whole cache can be handed out again.
    big = make_seq("big")
    bm.allocate(big, 20)
    assert sorted(big.block_table) == list(range(10))


def test_free_of_a_sequence_without_blocks_is_a_no_op():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq()
    bm.free(seq)
    bm.allocate(seq, 4)
    bm.free(seq)
    bm.free(seq)  # the table was cleared by the first free: nothing left to release
    assert bm.all_free()
    assert min(bm.ref_counts) == 0


def test_double_free_of_the_same_blocks_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 8)
    stale = list(seq.block_table)
    bm.free(seq)
    seq.block_table = stale  # a stale copy of a table that was already freed
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        bm.free(seq)


def test_rejected_double_free_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    x, y = make_seq("x"), make_seq("y")
    bm.allocate(x, 8)
    stale = list(x.block_table)  # [0, 1]
    bm.free(x)
    bm.allocate(y, 4)  # y reuses block 1
    assert y.block_table == [1]
    before = (list(bm.ref_counts), list(bm.free_blocks))
    x.block_table = stale
    with pytest.raises(RuntimeError):
        bm.free(x)
    assert min(bm.ref_counts) >= 0
    assert 1 not in bm.free_blocks, "block 1 is still y's but is on the free list"
    assert (list(bm.ref_counts), list(bm.free_blocks)) == before


def test_zero_blocks_is_rejected():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)


# op: (kind, sequence index, token count). Kinds: 0 = allocate up to n tokens, 1 = free.
ops_strategy = st.lists(
    st.tuples(st.sampled_from([0, 0, 0, 1]), st.integers(0, 5), st.integers(1, 40)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4, 8, 16]), ops=ops_strategy)
def test_random_allocate_free_sequences_keep_invariants(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    seqs = [make_seq(str(i)) for i in range(6)]
    covered = [0] * len(seqs)  # tokens each sequence has slots for
    for kind, idx, n in ops:
        seq = seqs[idx]
        if kind == 0:
            target = max(covered[idx], n)
            before = (list(seq.block_table), bm.num_free_blocks)
            need = bm.blocks_needed(seq, target)
            assert need == max(-(-target // block_size) - len(seq.block_table), 0)
            if need <= bm.num_free_blocks:
                assert bm.can_allocate(seq, target)
                bm.allocate(seq, target)
                covered[idx] = target
                assert len(seq.block_table) * block_size >= target
                assert len(seq.block_table) == -(-target // block_size)
                assert seq.block_table[:len(before[0])] == before[0], "existing blocks moved"
            else:
                assert not bm.can_allocate(seq, target)
                with pytest.raises(RuntimeError):
                    bm.allocate(seq, target)
                assert (seq.block_table, bm.num_free_blocks) == before
        else:
            bm.free(seq)
            covered[idx] = 0
            assert seq.block_table == []
        check_invariants(bm, seqs)
        assert min(bm.ref_counts) >= 0
    for seq in seqs:
        bm.free(seq)
    assert bm.all_free()
