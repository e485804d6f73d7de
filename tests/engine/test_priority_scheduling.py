"""The "priority" scheduling policy (vLLM's `--scheduling-policy priority`): the queue and
the running batch in (priority, arrival) order, lower first; preemption takes the least
urgent, latest arrival; nothing changes under "fcfs". Then the engine end to end: urgent
requests finish first, preempted ones still give their unpreempted output."""
from __future__ import annotations

import pytest

from tessera import LLM, SamplingParams
from tessera.config import ConfigError, SchedulerConfig
from tessera.engine.block_manager import BlockManager
from tessera.engine.engine import RequestError
from tessera.engine.scheduler import Scheduler
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)
from tests.engine.test_scheduler import make_seq, run_step, summary

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


def make_scheduler(num_blocks: int, max_num_seqs: int = 4, policy: str = "priority") -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, scheduling_policy=policy)
    return Scheduler(config, BlockManager(num_blocks, 4))


_clock = iter(range(1, 10**6))


def with_priority(name: str, priority: int, prompt_len: int = 4, max_new_tokens: int = 8):
    """A sequence arriving after every one made before (an explicit clock: no ties)."""
    seq = make_seq(prompt_len, max_new_tokens=max_new_tokens, name=name)
    seq.priority, seq.arrival_time = priority, float(next(_clock))
    return seq


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for name, priority in (("late-low", 5), ("urgent", -1), ("normal-a", 0), ("normal-b", 0)):
        sched.add(with_priority(name, priority))
    assert [s.request_id for s in sched.waiting] == ["urgent", "normal-a", "normal-b", "late-low"]
    assert summary(sched.schedule()) == [("urgent", 4), ("normal-a", 4)]


def test_fcfs_ignores_priorities_and_keeps_arrival_order():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, policy="fcfs")
    for name, priority in (("first", 5), ("second", -1), ("third", 0)):
        sched.add(with_priority(name, priority))
    assert summary(sched.schedule()) == [("first", 4), ("second", 4)]


def test_preemption_takes_the_least_urgent_running_sequence_and_requeues_it_by_priority():
    sched = make_scheduler(num_blocks=4, max_num_seqs=3)
    low, high, mid, later, waiting = (with_priority("low", 9), with_priority("high", 0), with_priority("mid", 5),
                                      with_priority("later", 9), with_priority("waiting", 7))
    for seq in (low, high, mid):
        sched.add(seq)
    out = sched.schedule()
    assert summary(out) == [("high", 4), ("mid", 4), ("low", 4)]
    run_step(sched, out)
    sched.add(later)
    sched.add(waiting)
    # each decode needs a second block; one is free: "low" goes, though it arrived first,
    # and queues behind the more urgent "waiting", ahead of the later "later"
    out = sched.schedule()
    assert out.preempted == [low] and summary(out) == [("high", 1), ("mid", 1)]
    assert [s.request_id for s in sched.waiting] == ["waiting", "low", "later"]
    assert sched.running == [high, mid]


def test_an_urgent_arrival_waits_for_room_rather_than_preempting():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    sched.add(with_priority("running", 9))
    run_step(sched, sched.schedule())
    sched.add(with_priority("urgent", -5))
    out = sched.schedule()
    assert summary(out) == [("running", 1)] and not out.preempted


def test_an_urgent_sequence_admitted_later_is_served_first_and_preempted_last():
    sched = make_scheduler(num_blocks=3, max_num_seqs=2)
    low, urgent = with_priority("low", 9), with_priority("urgent", 0)
    sched.add(low)
    run_step(sched, sched.schedule())
    sched.add(urgent)
    out = sched.schedule()  # admitted behind the running "low"
    assert summary(out) == [("low", 1), ("urgent", 4)]
    run_step(sched, out)
    out = sched.schedule()  # both decode; room for one: the urgent one runs
    assert summary(out) == [("urgent", 1)] and out.preempted == [low]


def test_a_least_urgent_sequence_that_cannot_grow_steps_aside_for_those_after_it():
    """"low" (admitted first) needs a block when none is free: it is the victim itself, and
    the urgent sequence after it in the batch still runs this step."""
    sched = make_scheduler(num_blocks=3, max_num_seqs=2)
    low = with_priority("low", 9, prompt_len=1, max_new_tokens=30)
    urgent = with_priority("urgent", 0, prompt_len=3, max_new_tokens=30)
    sched.add(low)
    run_step(sched, sched.schedule())
    sched.add(urgent)
    for _ in range(3):
        out = sched.schedule()
        assert not out.preempted
        run_step(sched, out)
    assert sched.running == [low, urgent] and len(low.block_table) * 4 == low.num_computed_tokens  # full: its next token needs a block
    out = sched.schedule()
    assert out.preempted == [low] and summary(out) == [("urgent", 1)]


def test_an_urgent_prompt_never_stalls_running_decodes():
    """The running batch keeps admission order: decodes first, then the urgent prompt's
    chunks from what is left of the budget (as under fcfs, and as in vLLM)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority")
    sched = Scheduler(config, BlockManager(256, 4))
    sched.add(with_priority("low", 5, max_new_tokens=50))
    run_step(sched, sched.schedule())
    sched.add(with_priority("urgent", 0, prompt_len=300))
    for _ in range(3):
        out = sched.schedule()
        assert summary(out) == [("low", 1), ("urgent", 63)]
        run_step(sched, out)


def test_a_requests_later_sequences_queue_ahead_of_newer_requests_of_their_priority():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    first = with_priority("n3", 2)
    children = [with_priority("n3", 2) for _ in range(2)]
    for index, child in enumerate(children, 1):  # as Engine.add_request makes them
        child.index, child.arrival_time = index, first.arrival_time
    urgent, newer = with_priority("urgent", 1), with_priority("newer", 2)
    for seq in (urgent, newer):
        sched.add(seq)
    for child in reversed(children):  # what the engine does once the first has its prompt
        sched.requeue(child)
    assert list(sched.waiting) == [urgent, *children, newer]


def test_bad_policies_and_priorities_are_errors(tiny):
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")
    with LLM(tiny, show_progress=False, num_kv_blocks=64, dtype="float32") as fcfs:
        with pytest.raises(RequestError, match="needs the priority scheduling policy"):
            fcfs.generate(TEXTS[:1], SamplingParams(max_new_tokens=2), priority=[3])
        assert fcfs.engine.requests == {}
        assert fcfs.generate(TEXTS[:1], SamplingParams(max_new_tokens=2), priority=[0])[0].finished
    with LLM(tiny, show_progress=False, num_kv_blocks=64, dtype="float32", scheduling_policy="priority") as llm:
        with pytest.raises(RequestError, match="integer"):
            llm.generate(TEXTS[:1], SamplingParams(max_new_tokens=2), priority=[1.5])
        with pytest.raises(ValueError, match="one integer per prompt"):
            llm.generate(TEXTS[:2], SamplingParams(max_new_tokens=2), priority=[1])
        assert llm.engine.requests == {}


def test_urgent_requests_finish_first_and_preempted_ones_keep_their_output(tiny):
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    with LLM(tiny, show_progress=False, num_kv_blocks=64, block_size=4, dtype="float32") as plain:
        expected = {i: o.outputs[0].token_ids for i, o in enumerate(plain.generate(TEXTS[:6], params))}
    # 14 blocks of 4 tokens: four sequences of ~35 tokens cannot all grow; the least urgent give way
    with LLM(tiny, show_progress=False, num_kv_blocks=14, block_size=4, dtype="float32", max_num_seqs=4,
             scheduling_policy="priority") as llm:
        engine, priorities = llm.engine, [3, 0, 2, 1, 4, 5]
        seqs = [engine.add_request(f"r{i}", TEXTS[i], params, priority=p) for i, p in enumerate(priorities)]
        order = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    order.append(int(out.request_id[1:]))
                    assert out.outputs[0].token_ids == expected[order[-1]], order[-1]
        assert engine.scheduler.num_preemptions > 0, "test setup: the cache is too small for all"
        assert seqs[1].num_preemptions == 0, "the most urgent is never preempted"
        assert seqs[0].num_preemptions > 0
        assert order == sorted(range(6), key=priorities.__getitem__)  # [1, 3, 2, 0, 4, 5]
        assert engine.block_manager.all_free()


def test_the_command_line_sets_the_policy():
    from tessera.cli import build_parser
    from tessera.engine_args import engine_config_from_args

    assert engine_config_from_args(build_parser().parse_args(["serve"])).scheduler.scheduling_policy == "fcfs"
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert engine_config_from_args(args).scheduler.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling-policy", "lifo"])
