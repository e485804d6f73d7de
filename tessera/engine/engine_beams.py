"""The engine's side of beam search (mixed into tessera.engine.engine.Engine): checking a
request, and after each step, once every live beam of a request has its candidates,
turning the search's choice (engine/beam_search.py) into sequences.

Beams share KV blocks: a beam continued twice forks, the fork taking a reference to each of
its parent's blocks (and, in a model with recurrent layers, a state slot holding a copy of
its parent's state), and any beam whose next token goes into a block another beam still
holds takes a copy of that block first (copy-on-write; full blocks are never written again,
so they stay shared). Beams skip detokenization while they search unless stop strings are
set (their candidates' text is searched for them then); a hypothesis' text is decoded
once, when the request ends.
"""
from __future__ import annotations

import copy

from tessera.engine.beam_search import BeamSearch, Candidate, Hypothesis
from tessera.engine.block_manager import BlockManager
from tessera.engine.detokenizer import detokenize_incrementally, flush, text_delta
from tessera.engine.output_processor import Delta, OutputProcessor
from tessera.engine.request_checks import RequestError
from tessera.engine.scheduler import Scheduler
from tessera.engine.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from tessera.engine.stop import find_stop
from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import TokenLogprobs


class BeamSearchMethods:
    scheduler: Scheduler
    block_manager: BlockManager
    output_processor: OutputProcessor

    def _check_beam_request(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """What a beam search request needs of this engine (RequestError if it cannot run)."""
        width = params.beam_width
        why = None
        if self.proposer is not None:
            why = "speculative decoding is on (its drafts verify one sequence at a time)"
        elif width > self.config.scheduler.max_num_seqs:
            why = f"its {width} beams exceed --max-num-seqs {self.config.scheduler.max_num_seqs}"
        else:
            longest = min(num_prompt_tokens + params.max_new_tokens, self.max_model_len)
            need = width * self.block_manager.num_blocks_for(longest)
            if need > self.block_manager.num_blocks:
                why = (f"its {width} beams of up to {longest} tokens need {need} KV blocks, the cache "
                       f"holds {self.block_manager.num_blocks} (lower max_tokens or the width)")
        if why is not None:
            raise RequestError(f"beam search cannot run: {why}", param="use_beam_search")

    def _new_beam_search(self, params: SamplingParams) -> BeamSearch:
        return BeamSearch(params.beam_width, params.length_penalty, params.early_stopping,
                          keep=params.beam_candidates(len(self.router.eos_token_ids)))

    def _advance_beams(self, group: SequenceGroup) -> dict[Sequence, Delta] | None:
        """After a step: if every live beam of `group` has its candidates, run the search's
        step; returns the outputs' deltas when the request has ended (its n best hypotheses
        are then `group.seqs`), else None."""
        beams = group.seqs
        if any(beam.beam_candidates is None for beam in beams):
            return None  # some beam's step is still to come (preempted, or not scheduled yet)
        search: BeamSearch = group.beams
        first = beams[0]
        generated = first.num_output_tokens + 1
        longest = min(first.num_prompt_tokens + first.params.max_new_tokens, first.max_total_tokens)
        going_on = search.step(beams, self._beam_end, generated, longest - first.num_prompt_tokens)
        for beam in beams:
            beam.beam_candidates = None
        if search.done:
            return self._finish_beams(group, beams)
        group.seqs = self._continue_beams(beams, going_on)
        return None

    def _beam_end(self, candidate: Candidate) -> FinishReason | None:
        """How `candidate` ends its beam (as append_token decides for a sampled token)."""
        parent, token, params = candidate.parent, candidate.token, candidate.parent.params
        may_stop = parent.num_output_tokens + 1 >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.router.eos_token_ids:
            return FinishReason.EOS
        if may_stop and token in params.stop_token_ids:
            return FinishReason.STOP
        if may_stop and params.stop:  # the text the token adds to its parent's, searched as append_token does
            added = text_delta(self.output_processor.decode, parent, parent.token_ids + [token])
            match = find_stop(parent.text + added, len(added), params.stop)
            if match is not None:
                candidate.stop = match.stop
                candidate.stop_text = (parent.text + added)[:match.end(params.include_stop_str_in_output)]
                return FinishReason.STOP
        return FinishReason.LENGTH if parent.at_length_limit(extra=1) else None

    def _continue_beams(self, beams: list[Sequence], going_on: list[Candidate]) -> list[Sequence]:
        """The next beams: each continuation on its parent (the first one) or on a fork of it,
        then the beams nothing continues ended and shared blocks about to be written copied."""
        parents = {id(c.parent) for c in going_on}
        for beam in beams:  # first: their blocks and state slots go to the forks
            if id(beam) not in parents:
                self.scheduler.finish(beam)  # (it is no output)
        taken: set[int] = set()
        assigned = []
        for candidate in going_on:  # forks before extensions: each copies its parent as it was
            parent = candidate.parent
            seq = self._fork(parent) if id(parent) in taken else parent
            taken.add(id(parent))
            assigned.append((seq, candidate))
        out = []
        for index, (seq, candidate) in enumerate(assigned):
            self._extend(seq, candidate)
            if seq.params.stop:  # (its text, for the stop strings of its continuations; not handed out)
                detokenize_incrementally(self.output_processor.decode, seq)
            seq.index = index
            out.append(seq)
        self._copy_on_write(out)
        return out

    def _fork(self, parent: Sequence) -> Sequence:
        """A second beam with `parent`'s tokens, holding references to its blocks."""
        child = copy.copy(parent)
        child.token_ids = list(parent.token_ids)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.logprobs = None if parent.logprobs is None else list(parent.logprobs)
        child.draft_token_ids = []
        self.block_manager.share(child.block_table)
        child.decode_snapshot = None  # (its parent's to forget: engine/state_cache.py)
        if parent.status is SequenceStatus.RUNNING:
            if parent.state_slot is not None:  # recurrent layers: a slot holding a copy of the state
                child.state_slot = self.scheduler.take_state_slot()
                copies = [(parent.state_slot, child.state_slot)]
                self._on_ranks(lambda: self.runner.fork_states(copies))
            self.scheduler.running.append(child)
        else:  # (a preempted parent holds no blocks: the fork recomputes as it will)
            self.scheduler.requeue(child)
        return child

    def _extend(self, seq: Sequence, candidate: Candidate) -> None:
        seq.token_ids.append(candidate.token)
        seq.cumulative_logprob = candidate.score
        if seq.logprobs is not None:
            seq.logprobs.append(self._position_logprobs(seq, candidate))

    def _position_logprobs(self, seq: Sequence, candidate: Candidate):
        row = candidate.row
        return self.output_processor.position_logprobs(
            TokenLogprobs(candidate.token, candidate.logprob, candidate.rank, row.top[:seq.params.logprobs or 0]))

    def _copy_on_write(self, beams: list[Sequence]) -> None:
        """Give each running beam whose next token goes into a block another holds its own
        copy of that block (none free: the beam is preempted, to recompute later)."""
        manager, copies = self.block_manager, []
        for seq in beams:
            at = seq.num_computed_tokens
            index = at // manager.block_size
            writes_a_new_block = at % manager.block_size == 0 or index >= len(seq.block_table)
            if seq.status is not SequenceStatus.RUNNING or writes_a_new_block:
                continue
            if not manager.is_shared(seq.block_table[index]):
                continue
            pair = manager.unshare(seq, index)
            if pair is None:
                self.scheduler.preempt(seq)
            else:
                copies.append(pair)
        if copies:
            self._on_ranks(lambda: self.runner.copy_kv_blocks(copies))

    def _finish_beams(self, group: SequenceGroup, beams: list[Sequence]) -> dict[Sequence, Delta]:
        """End the request: its live beams go, its n best hypotheses become its outputs."""
        for beam in beams:
            self.scheduler.finish(beam)
        search: BeamSearch = group.beams
        n = group.params.n
        group.seqs = [self._hypothesis(h, index) for index, h in enumerate(search.best(n))]
        if not group.seqs:  # nothing ended and nothing could go on (every token masked)
            group.seqs = [self._cut_short(beam, index) for index, beam in enumerate(beams[:n])]
        return {seq: (seq.text, seq.output_token_ids) for seq in group.seqs}

    def _cut_short(self, beam: Sequence, index: int) -> Sequence:
        """A live beam ended as it is, as a sequence whose constraint allows nothing more ends."""
        seq = _finished_copy(beam, index, FinishReason.ABORT)
        self._decode_whole(seq, None)
        return seq

    def _decode_whole(self, seq: Sequence, end: int | None) -> None:
        """`seq.text`: its output decoded at once (up to `end`), all of it handed out."""
        seq.text, seq.read_offset = "", seq.num_prompt_tokens
        seq.prefix_offset = max(seq.read_offset - 6, 0)  # (as a new sequence's: see Sequence)
        flush(self.output_processor.decode, seq, end)
        seq.num_emitted_chars = len(seq.text)

    def _hypothesis(self, hypothesis: Hypothesis, index: int) -> Sequence:
        """A finished sequence: the hypothesis' parent and token, its text decoded."""
        candidate = hypothesis.candidate
        seq = _finished_copy(candidate.parent, index, hypothesis.reason)
        seq.token_ids = list(hypothesis.parent_token_ids)  # (its parent may have moved on since)
        seq.logprobs = None if hypothesis.parent_logprobs is None else list(hypothesis.parent_logprobs)
        seq.cumulative_logprob = hypothesis.parent_cumulative
        self._extend(seq, candidate)
        stop_token = hypothesis.reason is FinishReason.EOS or (
            hypothesis.reason is FinishReason.STOP and candidate.stop is None)
        seq.stop_reason = candidate.token if stop_token and hypothesis.reason is FinishReason.STOP else None
        end = seq.num_tokens - 1 if stop_token and not seq.params.include_stop_str_in_output else None
        if candidate.stop is not None:  # its text as the search found it, cut at the stop string
            seq.text, seq.stop_reason = candidate.stop_text, candidate.stop
            seq.num_emitted_chars = len(seq.text)
        else:
            self._decode_whole(seq, end)
        return seq


def _finished_copy(beam: Sequence, index: int, reason: FinishReason) -> Sequence:
    """An output of the search: a copy of `beam` that holds no blocks, slot or snapshot."""
    seq = copy.copy(beam)
    seq.block_table, seq.block_hashes, seq.draft_token_ids = [], [], []
    seq.state_slot = seq.decode_snapshot = None
    seq.index, seq.status, seq.finish_reason = index, SequenceStatus.FINISHED, reason
    return seq
