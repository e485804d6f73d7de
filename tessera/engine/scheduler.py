"""Continuous batching under one token budget per step.

Each step: running sequences first (a decode needs one token; a sequence still in its
prompt gets its next chunk), then waiting sequences in arrival order fill what is left of
the budget and of `max_num_seqs`. When blocks run out, the most recently arrived running
sequence is preempted: its blocks are freed and it is recomputed later from its tokens.

Under the "priority" policy (vLLM's), the queue is in (priority, arrival) order, lower
priority values first, and preemption takes the running sequence that is least urgent,
then latest to arrive (if it was already given tokens this step, they are taken back). The
running batch keeps its admission order, so its decodes still come before a newly admitted
urgent prompt's chunks. A waiting request is never admitted by preempting a running one
(as in vLLM): a more urgent arrival takes the next free room.

With async scheduling a running sequence may have a token sampled by a launched step that
the host has not read yet (`num_pending_tokens`): it counts as a token to compute, and a
sequence that token will bring to its length limit is not scheduled again.

With speculative decoding a decoding sequence may carry draft tokens. They are added last,
after every running sequence and admission has its tokens, from the budget and free blocks
left over, so they never take a step's room from a real token and never cause a
preemption; drafts that do not fit are dropped (the next step proposes again). The blocks
that rejected drafts were given are handed back in `step_done`.

A chunk never ends inside an image whose tokens attend to each other (Gemma 3): it stops
before the image, or, where it starts there, takes the whole image even past the budget (by
at most one image's tokens; waiting for a step with room would starve the image behind
running decodes).

With LoRA adapters, the running batch holds sequences of at most `max_loras` distinct
adapters (the device's slots); a waiting sequence whose adapter would exceed that is passed
over. Behind it only base-model sequences may go first: another request of a running
adapter would keep that adapter's slot taken, and a steady stream of them would starve the
passed-over one forever; held back, the running adapters drain and free a slot.

A model with recurrent layers (linear attention) keeps a state per running sequence in one
of `max_num_seqs` slots: a sequence takes a free one when admitted and gives it back when
preempted or finished. The running batch never exceeds max_num_seqs, so admission never
waits for a slot; a preempted sequence recomputes from position 0, which starts its
state afresh (the step's metadata says so). With prefix caching such a model's prefill
chunks stop at the prompt's last block boundary, chunks ending on a boundary save a
snapshot of the state, and admission restores one (engine/state_cache.py).
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tessera.config import SchedulerConfig
from tessera.engine.block_manager import BlockManager, PrefixMatch
from tessera.engine.sequence import Sequence, SequenceStatus
from tessera.engine.state_cache import StateCache


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # speculative decoding: proposed tokens after the sequence's own (the last of the
    # num_new_tokens); the step samples after each of them too, to verify them
    draft_token_ids: list[int] = field(default_factory=list)
    # recurrent layers with prefix caching (engine/state_cache.py): the snapshot slot copied
    # into the sequence's own before this step, and the one its state is saved to after it
    restore_from: int | None = None
    save_to: int | None = None

    @property
    def num_real_tokens(self) -> int:
        """This step's tokens that are the sequence's own (not drafts)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens (so it samples one;
        an embedding request samples nothing)."""
        seq = self.seq
        return seq.pooling is None and seq.num_computed_tokens + self.num_real_tokens == seq.num_tokens + seq.num_pending_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_loras: int | None = None,
                 state_slots: bool = False, state_cache: StateCache | None = None):
        """`state_slots`: the model has recurrent layers; running sequences get state slots.
        `state_cache`: their snapshots at block boundaries, for prefix caching."""
        self.config = config
        self.state_cache = state_cache
        self.free_state_slots: list[int] | None = list(range(config.max_num_seqs - 1, -1, -1)) if state_slots else None
        self.blocks = block_manager
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def add(self, seq: Sequence) -> None:
        """Queue a new request's sequence (behind every earlier one of its priority)."""
        if self.by_priority:
            self._insert(seq)
        else:
            self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Queue a sequence ahead of newer requests: a preempted one, or a request's later
        sequences (n / best_of) once the first has computed the prompt."""
        if self.by_priority:
            self._insert(seq)
        else:
            self.waiting.appendleft(seq)

    def _behind_its_group(self, seq: Sequence) -> None:
        """Queue `seq` right behind the last waiting sequence of its group (the beam it waits
        for), or ahead of newer requests if none waits; the priority policy keeps its order."""
        if self.by_priority:
            self._insert(seq)
            return
        mine = [i for i, other in enumerate(self.waiting) if other.group is seq.group]
        self.waiting.insert(mine[-1] + 1 if mine else 0, seq)

    def _insert(self, seq: Sequence) -> None:
        """Behind every waiting sequence at least as urgent (the queue stays sorted)."""
        self.waiting.insert(bisect.bisect_right(self.waiting, _urgency(seq), key=_urgency), seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the latest admitted, or the least urgent."""
        return max(self.running, key=_urgency) if self.by_priority else self.running[-1]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_pending_tokens
            if pending and seq.at_length_limit(pending):
                i += 1  # its pending token ends it: nothing more to compute
                continue
            remaining = seq.num_tokens + pending - seq.num_computed_tokens
            if remaining <= 0:  # a beam waiting for the rest of its search's beams
                i += 1
                continue
            n = min(remaining, budget)
            if not self.config.enable_chunked_prefill and n < remaining:
                break
            n = seq.chunk_size(seq.num_computed_tokens, self._state_aligned(seq, seq.num_computed_tokens, n))
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:  # given its tokens earlier in this step: take them back
                    i -= 1
                    given = next(item for item in out.scheduled if item.seq is victim)
                    out.scheduled.remove(given)
                    budget += given.num_new_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # `seq` itself went (the one at `i` is now the next)
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(self._planned(ScheduledSeq(seq, n)))
            budget -= n
            i += 1
        if out.preempted:
            self._drop_drafts()
            return out  # no admissions (nor drafts) in a step that had to give blocks back
        adapters = {seq.lora.key for seq in self.running if seq.lora is not None} if self.max_loras else set()
        slots = _Slots(self.running)
        passed = 0  # waiting sequences passed over: their adapter cannot join this batch
        while passed < len(self.waiting) and budget > 0:
            seq = self.waiting[passed]
            if not slots.fits(seq, self.config.max_num_seqs):
                break
            if seq.lora is not None and (passed or (seq.lora.key not in adapters
                                                    and len(adapters) >= (self.max_loras or 0))):
                passed += 1  # (behind a passed-over one, only the base model goes ahead)
                continue
            # prompt logprobs (and mean pooling) need every prompt position: no cached prefix then
            match = (PrefixMatch([], [], 0) if seq.computes_whole_prompt
                     else self._with_state(self.blocks.match_prefix(seq)))
            cached = len(match.blocks) * self.blocks.block_size
            n = seq.num_tokens - cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = seq.chunk_size(cached, budget)
            aligned = self._state_aligned(seq, cached, n)
            if aligned != n:
                n = seq.chunk_size(cached, aligned)
            fresh = self.blocks.num_blocks_for(cached + n) - len(match.blocks)
            if fresh + match.num_free > self.blocks.num_free_blocks:
                break
            del self.waiting[passed]
            if seq.lora is not None:
                adapters.add(seq.lora.key)
            seq.num_computed_tokens = self.blocks.take_prefix(seq, match)
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            slots.take(seq)
            seq.status = SequenceStatus.RUNNING
            if self.free_state_slots is not None:
                seq.state_slot = self.free_state_slots.pop()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            item = ScheduledSeq(seq, n)
            if match.blocks and self.state_cache is not None:  # (before _planned may evict it)
                item.restore_from = self.state_cache.lookup(match.hashes[-1])
            out.scheduled.append(self._planned(item))
            budget -= n
        if not out.scheduled and self.waiting and self._preempt_idle():
            return self.schedule()
        self._add_drafts(out, budget)
        return out

    def _preempt_idle(self) -> bool:
        """Nothing could run: where running sequences wait with nothing to compute (beams
        waiting for a preempted beam of their search that has no room to come back), the
        latest of them gives its blocks back. Returns whether one did."""
        idle = [s for s in self.running if s.num_tokens + s.num_pending_tokens <= s.num_computed_tokens]
        if not idle:
            return False
        victim = idle[-1]
        self.running.remove(victim)
        self._preempt(victim, behind=True)
        return True

    # --- recurrent state with prefix caching (engine/state_cache.py) ------------------------

    def _with_state(self, match: PrefixMatch) -> PrefixMatch:
        """The longest part of a cached prefix that ends where a state snapshot does (all of
        it without recurrent layers)."""
        if self.state_cache is None or not match.blocks:
            return match
        keep = next((i + 1 for i in range(len(match.blocks) - 1, -1, -1) if match.hashes[i] in self.state_cache), 0)
        blocks = match.blocks[:keep]
        return PrefixMatch(blocks, match.hashes[:keep], sum(self.blocks.ref_counts[b] == 0 for b in blocks))

    def _state_aligned(self, seq: Sequence, start: int, n: int) -> int:
        """A chunk of `n` tokens from `start`, cut at the last block boundary before the
        sequence's last token when it would run past it: the state there is what a later
        prompt with this prefix restores."""
        if self.state_cache is None:
            return n
        size = self.blocks.block_size
        boundary = (seq.num_tokens - 1) // size * size
        return boundary - start if start < boundary < start + n else n

    def _planned(self, item: ScheduledSeq) -> ScheduledSeq:
        """Give a chunk that ends on a block boundary a snapshot slot to save its state to."""
        end = item.seq.num_computed_tokens + item.num_new_tokens
        if self.state_cache is not None and end % self.blocks.block_size == 0:
            item.save_to = self.state_cache.take(decoding=end > item.seq.num_prompt_tokens)
        return item

    def _register_snapshot(self, item: ScheduledSeq) -> None:
        """After the step: the saved state is findable under the hash of the block it ends
        (given back if the sequence moved on otherwise). A sequence keeps one snapshot of
        its decoding, the latest."""
        seq, cache = item.seq, self.state_cache
        end = seq.num_computed_tokens
        index = end // self.blocks.block_size - 1
        if seq.status is not SequenceStatus.RUNNING or index < 0 or index >= len(seq.block_hashes):
            cache.release(item.save_to)
            return
        block_hash = seq.block_hashes[index]
        decoding = end > seq.num_prompt_tokens
        if not cache.register(block_hash, item.save_to, decoding) or not decoding:
            return
        if seq.decode_snapshot is not None:
            cache.forget(seq.decode_snapshot)
        seq.decode_snapshot = block_hash

    def step_done(self, plan: SchedulerOutput, num_rejected: dict[Sequence, int] | None = None) -> None:
        """Record that the model computed the planned tokens (their KV is now cached).
        `num_rejected`: per sequence, its trailing drafts the step did not accept; their
        KV is garbage (computed from tokens the sequence does not have) and is recomputed
        over."""
        for item in plan.scheduled:
            if item.seq.is_finished:  # finished while its step ran (async scheduling)
                if item.save_to is not None:
                    self.state_cache.release(item.save_to)
                continue
            rejected = num_rejected.get(item.seq, 0) if num_rejected else 0
            item.seq.num_computed_tokens += item.num_new_tokens - rejected
            if rejected:  # the next step computes one token: blocks past it go back
                self.blocks.trim(item.seq, item.seq.num_computed_tokens + 1)
            self.blocks.cache_full_blocks(item.seq)
            if item.save_to is not None:
                self._register_snapshot(item)

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give decoding sequences their drafts from what the step left: `budget` tokens
        and the free blocks. Proposed drafts are used by this step or dropped."""
        block_size = self.blocks.block_size
        for item in out.scheduled:
            seq = item.seq
            drafts = seq.draft_token_ids
            if not drafts or budget <= 0 or item.num_new_tokens != 1 or seq.num_pending_tokens or not item.samples:
                continue
            start = seq.num_computed_tokens + 1
            room = (len(seq.block_table) + self.blocks.num_free_blocks) * block_size - start
            count = min(len(drafts), budget, room)
            if count <= 0:
                continue
            self.blocks.allocate(seq, start + count)
            item.num_new_tokens += count
            item.draft_token_ids = drafts[:count]
            budget -= count
        self._drop_drafts()

    def _drop_drafts(self) -> None:
        """Drafts are proposed for the next step only: a sequence that step did not run
        gets new ones when it next advances."""
        for seq in self.running:
            seq.draft_token_ids = []

    def take_state_slot(self) -> int:
        """A free state slot for a running sequence that did not come through admission (a
        beam's fork: its search's width is reserved in max_num_seqs, so one is free)."""
        return self.free_state_slots.pop()

    def _release_state_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence between steps (its blocks go back; it recomputes)."""
        self.running.remove(seq)
        self._preempt(seq)

    def _preempt(self, seq: Sequence, behind: bool = False) -> None:
        self.blocks.free(seq)
        self._release_state_slot(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if behind:
            self._behind_its_group(seq)
        else:
            self.requeue(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        self._release_state_slot(seq)
        seq.status = SequenceStatus.FINISHED


class _Slots:
    """The running batch's share of max_num_seqs: a sequence takes one; a beam search takes
    its width from its first running beam on, so that its forks always have room."""

    def __init__(self, running: list[Sequence]):
        widths: dict[int, int] = {}  # search (its group's id) -> its width
        beams = 0
        for seq in running:  # (one pass: this runs every step)
            if _searching(seq):
                widths[id(seq.group)] = seq.params.beam_width
                beams += 1
        self.searches = set(widths)
        self.used = len(running) - beams + sum(widths.values())

    def cost(self, seq: Sequence) -> int:
        if not _searching(seq):
            return 1
        return 0 if id(seq.group) in self.searches else seq.params.beam_width

    def fits(self, seq: Sequence, limit: int) -> bool:
        return self.used + self.cost(seq) <= limit

    def take(self, seq: Sequence) -> None:
        self.used += self.cost(seq)
        if _searching(seq):
            self.searches.add(id(seq.group))


def _searching(seq: Sequence) -> bool:
    return seq.group is not None and seq.group.beams is not None


def _urgency(seq: Sequence) -> tuple[int, float, int]:
    """The priority policy's order: priority, then arrival, then the request's sequence index."""
    return seq.priority, seq.arrival_time, seq.index
