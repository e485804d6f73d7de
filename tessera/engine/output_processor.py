"""From sampled tokens to what callers see: append the token, detokenize incrementally,
decide whether the sequence is finished (EOS, stop token ids, stop strings, length) and
what text may be handed out, and assemble RequestOutputs (see outputs.py for the
streaming contract)."""
from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from tessera.engine.detokenizer import detokenize_incrementally, fast_decoder, flush
from tessera.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tessera.engine.sequence import FinishReason, Sequence, SequenceGroup
from tessera.engine.stop import find_stop, partial_stop_length
from tessera.sampling.sampler import TokenLogprobs

logger = logging.getLogger(__name__)

Delta = tuple[str, list[int]]  # text and token ids one step added to a sequence


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.decode = fast_decoder(tokenizer)
        self.eos_token_ids = eos_token_ids
        self._token_text: dict[int, str] = {}

    # --- logprobs -----------------------------------------------------------------------------

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (cached; a piece of a multi-byte character reads
        as U+FFFD, as in vLLM and TGI)."""
        missing = sorted({t for t in token_ids if t not in self._token_text})
        if missing:
            texts = self.tokenizer.batch_decode([[t] for t in missing], skip_special_tokens=False)
            self._token_text.update(zip(missing, texts))
        return [self._token_text[t] for t in token_ids]

    def position_logprobs(self, info: TokenLogprobs) -> PositionLogprobs:
        ids = [info.token_id] + [t for t, _ in info.top]
        texts = self.token_texts(ids)
        out = {info.token_id: Logprob(info.logprob, info.rank, texts[0])}
        for rank, ((token, logprob), text) in enumerate(zip(info.top, texts[1:]), 1):
            out.setdefault(token, Logprob(logprob, rank, text))
        return out

    def record_prompt_logprobs(self, seq: Sequence, start: int, infos: list[TokenLogprobs]) -> None:
        """Logprobs of prompt positions start.. (position p predicts token p + 1); positions
        already recorded (a recompute after preemption) are skipped."""
        done = seq.num_prompt_logprobs_done
        for position, info in enumerate(infos, start):
            if position == done:
                seq.prompt_logprobs.append(self.position_logprobs(info))
                done += 1

    # --- tokens -------------------------------------------------------------------------------

    def append_token(self, seq: Sequence, token: int, info: TokenLogprobs | None) -> Delta:
        """Add a sampled token; sets `seq.finish_reason` when it ends the sequence and
        returns the text and token ids to hand out for it."""
        params = seq.params
        grammar = None if seq.grammar_waits else seq.grammar  # the matcher this token advances
        if seq.grammar_may_open is not None:  # the first token: a reasoning, or the answer
            if token == seq.grammar_may_open:
                seq.grammar_waits, grammar = True, None
            seq.grammar_may_open = None
        if grammar is not None and not _accepts(grammar, token):
            # the constraint reached a state nothing can follow (a grammar with a rule that
            # never ends): this sequence ends, the step and the other requests go on
            logger.warning("request %s: its structured-output constraint allows no next token; "
                           "finishing it", seq.request_id)
            seq.finish_reason = FinishReason.ABORT
            return "", []
        seq.token_ids.append(token)
        if seq.thinking is not None:
            seq.thinking.advance(token, first=seq.num_output_tokens == 1)
        if seq.grammar_waits and token == params.reasoning_end_token_id:
            seq.grammar_waits = False  # the reasoning ended: the constraint takes the next token
        if info is not None:
            seq.cumulative_logprob += info.logprob
            if seq.logprobs is not None:
                seq.logprobs.append(self.position_logprobs(info))
        may_stop = seq.num_output_tokens >= params.min_tokens
        reason: FinishReason | None = None
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            reason = FinishReason.EOS
        elif grammar is not None and grammar.is_terminated():
            reason = FinishReason.EOS  # the constraint is complete and took its end token
        elif may_stop and token in params.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, token
        at_length = seq.at_length_limit()
        # A stop token's own text is not output unless include_stop_str_in_output (vLLM).
        end = seq.num_tokens - 1 if reason is not None and not params.include_stop_str_in_output else None
        before = len(seq.text)
        if reason is not None or at_length:
            detokenize_incrementally(self.decode, seq, end)
            flush(self.decode, seq, end)
        else:
            detokenize_incrementally(self.decode, seq)
        visible = len(seq.text)
        if reason is None and params.stop and may_stop:
            match = find_stop(seq.text, len(seq.text) - before, params.stop)
            if match is not None:
                reason, seq.stop_reason = FinishReason.STOP, match.stop
                visible = match.end(params.include_stop_str_in_output)
        if reason is None and at_length:
            reason = FinishReason.LENGTH
        if reason is None and params.stop and not params.include_stop_str_in_output:
            visible -= partial_stop_length(seq.text[seq.num_emitted_chars:], params.stop)
        visible = max(visible, seq.num_emitted_chars)  # handed-out text is never taken back
        if reason is not None:
            seq.finish_reason = reason
            seq.text = seq.text[:visible]
        delta = seq.text[seq.num_emitted_chars:visible]
        seq.num_emitted_chars = visible
        return delta, [token]

    # --- outputs ------------------------------------------------------------------------------

    @staticmethod
    def _metrics(group, now: float) -> dict[str, float]:
        """Monotonic times: arrival, first admission to the running batch (queue time ends),
        and this output."""
        metrics = {"arrival_time": group.seqs[0].arrival_time, "time": now}
        scheduled = [s.first_scheduled_time for s in group.seqs if s.first_scheduled_time is not None]
        if scheduled:
            metrics["first_scheduled_time"] = min(scheduled)
        return metrics

    def completion(self, seq: Sequence, delta: Delta | None) -> CompletionOutput:
        text, ids = delta if delta is not None else ("", [])
        return CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            delta_text=text, delta_token_ids=ids,
            cumulative_logprob=(seq.cumulative_logprob if seq.params.needs_logprobs or seq.params.use_beam_search
                                else None),
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            stop_reason=seq.stop_reason)

    def request_output(self, group: SequenceGroup, deltas: dict[Sequence, Delta],
                       now: float) -> RequestOutput:
        finished = group.is_finished
        if not finished:
            seqs = sorted(deltas, key=lambda s: s.index)
        else:
            params = group.params
            seqs = group.seqs
            if params.num_sequences > params.n and not params.use_beam_search:  # (beams: best first already)
                seqs = sorted(seqs, key=lambda s: (-s.cumulative_logprob, s.index))[:params.n]
        first = group.seqs[0]
        return RequestOutput(
            group.request_id, first.prompt, first.prompt_token_ids,
            [self.completion(s, deltas.get(s)) for s in seqs], finished=finished,
            metrics=self._metrics(group, now),
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens)  # (siblings admitted later reuse its blocks)


def _accepts(matcher, token: int) -> bool:
    try:
        return matcher.accept_token(token)
    except Exception:  # xgrammar raises for an id outside the vocabulary (all-masked rows)
        return False
