"""Scheduler: token budget, sequence cap, decode-first order, chunked prefill and preemption.

No model: a step is simulated by advancing `num_computed_tokens` by what was scheduled and
appending a token to every sequence whose chunk reached the end of its tokens.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.config import SchedulerConfig
from tessera.engine.block_manager import BlockManager
from tessera.engine.scheduler import Scheduler, SchedulerOutput
from tessera.engine.sequence import Sequence, SequenceStatus
from tessera.sampling.params import SamplingParams

_ids = itertools.count()


def make_seq(prompt_len: int, max_new_tokens: int = 4, name: str | None = None) -> Sequence:
    name = name or f"s{next(_ids)}"
    return Sequence(name, None, [5 + i % 100 for i in range(prompt_len)],
                    SamplingParams(max_new_tokens=max_new_tokens), 100_000)


def make_scheduler(num_blocks: int, block_size: int, budget: int, max_num_seqs: int = 4,
                   chunked: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Sequence]:
    """What the engine does after the model ran; returns the sequences that finished."""
    sampling = [item.seq for item in out.scheduled if item.samples]
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    finished = []
    for seq in sampling:
        seq.token_ids.append(token)
        if seq.num_output_tokens >= seq.params.max_new_tokens:
            sched.finish(seq)
            finished.append(seq)
    return finished


def summary(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in out.scheduled]


def test_new_sequences_are_admitted_in_arrival_order_up_to_max_num_seqs():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=256, max_num_seqs=2)
    seqs = [make_seq(5, name=f"w{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert summary(out) == [("w0", 5), ("w1", 5)]
    assert [s.request_id for s in sched.running] == ["w0", "w1"]
    assert [s.request_id for s in sched.waiting] == ["w2", "w3"]
    assert all(item.samples for item in out.scheduled)
    assert seqs[0].status is SequenceStatus.RUNNING and seqs[2].status is SequenceStatus.WAITING


def test_decodes_are_scheduled_before_new_prefills_and_prefills_get_the_rest_of_the_budget():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=8)
    a, b = make_seq(3, name="a"), make_seq(3, name="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert summary(out) == [("a", 3), ("b", 3)]
    run_step(sched, out)
    c = make_seq(20, name="c")
    sched.add(c)
    out = sched.schedule()
    # Both decodes first (one token each), then the new prompt takes the 6 tokens left.
    assert summary(out) == [("a", 1), ("b", 1), ("c", 6)]
    assert out.num_batched_tokens == 8
    assert [item.samples for item in out.scheduled] == [True, True, False]


def test_long_prompt_is_split_across_steps_and_samples_only_at_its_end():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=8)
    seq = make_seq(20, name="long")
    short = make_seq(2, name="short")
    sched.add(seq)
    sched.add(short)
    chunks, samples = [], []
    for _ in range(3):
        out = sched.schedule()
        assert out.num_batched_tokens <= 8
        item = out.scheduled[0]
        assert item.seq is seq
        assert item.seq.num_computed_tokens == sum(chunks)
        chunks.append(item.num_new_tokens)
        samples.append(item.samples)
        # Blocks cover exactly what has been computed plus this chunk.
        assert len(seq.block_table) == -(-(sum(chunks)) // 4)
        run_step(sched, out)
    assert chunks == [8, 8, 4]
    assert samples == [False, False, True]
    assert seq.num_computed_tokens == 20 and seq.num_tokens == 21
    # The short prompt only got in once the long one left budget over (last step: 4 + 2).
    assert short.num_computed_tokens == 2


def test_without_chunked_prefill_a_prompt_is_never_split():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=10, chunked=False)
    a, b = make_seq(6, name="a"), make_seq(6, name="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert summary(out) == [("a", 6)]  # b does not fit whole in the 4 tokens left
    run_step(sched, out)
    out = sched.schedule()
    assert summary(out) == [("a", 1), ("b", 6)]


def test_most_recent_running_sequence_is_preempted_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, max_num_seqs=3)
    a, b, c, d = (make_seq(4, max_new_tokens=8, name=n) for n in "abcd")
    for s in (a, b, c, d):
        sched.add(s)
    out = sched.schedule()
    assert summary(out) == [("a", 4), ("b", 4), ("c", 4)]  # d waits: max_num_seqs
    run_step(sched, out)
    assert sched.blocks.num_free_blocks == 1
    c_blocks = list(c.block_table)
    # Each decode now needs a second block; only one is free: c (the newest) gives its back.
    out = sched.schedule()
    assert summary(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [c]
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.block_table == []
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.num_tokens == 5  # its sampled token is kept and will be recomputed as prompt
    assert list(sched.waiting) == [c, d]  # front of the queue, ahead of d
    assert sched.running == [a, b]
    assert set(c_blocks) <= set(a.block_table + b.block_table)  # its block went to a or b
    assert sched.blocks.num_free_blocks == 0
    # A step that preempted admits nobody, even with budget left.
    assert all(item.seq in (a, b) for item in out.scheduled)
    run_step(sched, out)
    # When c comes back it recomputes all of its tokens, and samples at the end.
    sched.finish(a)
    sched.finish(b)
    out = sched.schedule()
    assert summary(out)[0] == ("c", 5)
    assert out.scheduled[0].samples


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=64)
    a, b = make_seq(4, name="a"), make_seq(4, name="b")
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    out = sched.schedule()
    assert summary(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.block_table == [] and b.status is SequenceStatus.WAITING
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_finish_frees_blocks_from_running_and_from_waiting():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_num_seqs=1)
    a, b = make_seq(6, name="a"), make_seq(6, name="b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.block_table and not b.block_table
    sched.finish(b)  # an abort while waiting
    assert list(sched.waiting) == [] and b.status is SequenceStatus.FINISHED
    sched.finish(a)
    assert sched.running == [] and a.status is SequenceStatus.FINISHED
    assert sched.blocks.all_free()
    assert not sched.has_unfinished()


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    prompts = draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8)), min_size=1, max_size=8))
    longest = max(p + n for p, n in prompts)
    # Enough blocks for the longest sequence alone (the engine guarantees that much).
    num_blocks = draw(st.integers(-(-longest // block_size), -(-longest // block_size) + 12))
    low = max(max_num_seqs, longest if not chunked else 1)
    budget = draw(st.integers(low, low + 40))
    arrivals = draw(st.lists(st.integers(0, 5), min_size=len(prompts), max_size=len(prompts)))
    return block_size, chunked, max_num_seqs, prompts, num_blocks, budget, arrivals


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_random_workloads_respect_limits_and_all_finish(workload):
    block_size, chunked, max_num_seqs, prompts, num_blocks, budget, arrivals = workload
    sched = make_scheduler(num_blocks, block_size, budget, max_num_seqs, chunked)
    bm = sched.blocks
    seqs = [make_seq(p, n) for p, n in prompts]
    pending = sorted(zip(arrivals, range(len(seqs))))
    finished: list[Sequence] = []
    for step in range(2000):
        while pending and pending[0][0] <= step:
            sched.add(seqs[pending.pop(0)[1]])
        if not pending and not sched.has_unfinished():
            break
        was_running = set(map(id, sched.running))
        out = sched.schedule()

        # Budget and sequence cap.
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        assert all(item.num_new_tokens >= 1 for item in out.scheduled)
        ids = [id(item.seq) for item in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        # Running sequences (decodes and continuing chunks) come before admissions.
        admitted = [id(i.seq) not in was_running for i in out.scheduled]
        assert admitted == sorted(admitted)
        if out.preempted:
            assert not any(admitted), "admitted a sequence in a step that preempted"
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            end = seq.num_computed_tokens + item.num_new_tokens
            assert end <= seq.num_tokens
            assert len(seq.block_table) * block_size >= end, "chunk has no KV slots"
            if not chunked:
                assert end == seq.num_tokens
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq in sched.waiting
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert id(seq) not in ids
        # Block ownership: running sequences own disjoint blocks, waiting ones own none.
        owned = [b for s in sched.running for b in s.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == num_blocks
        assert all(not s.block_table for s in sched.waiting)
        assert min(bm.ref_counts) >= 0
        if sched.has_unfinished():
            # The engine treats an empty plan with requests pending as an error.
            assert not out.is_empty, "no progress with requests pending"
        finished += run_step(sched, out)
    else:
        pytest.fail("workload did not finish")
    assert len(finished) == len(seqs)
    for seq in seqs:
        assert seq.num_output_tokens == seq.params.max_new_tokens
        assert seq.status is SequenceStatus.FINISHED
    assert bm.all_free()
