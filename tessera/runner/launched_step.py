"""A step whose device work has been queued: its sampled tokens reach the host when
`result()` is called. On CUDA the tokens are copied into pinned host memory behind the
step's kernels, so the host can schedule and launch the next step (which reads them on the
device) before waiting; on CPU the work is already done when the step is returned."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.engine.scheduler import ScheduledSeq
from tessera.engine.sequence import Sequence
from tessera.runner.inputs import ModelInputs, PromptRows
from tessera.sampling.sampler import SamplerOutput, TokenLogprobs, rewind_draws


@dataclass
class SampledToken:
    item: ScheduledSeq
    token_id: int
    logprobs: TokenLogprobs | None = None
    beam_candidates: TokenLogprobs | None = None  # a beam search row's (engine/beam_search.py)


@dataclass
class StepResult:
    # in row order; a sequence with accepted drafts has several, in token order
    samples: list[SampledToken] = field(default_factory=list)
    # per sequence asking for prompt logprobs: its rows and their logprobs, in position order
    prompt_logprobs: list[tuple[PromptRows, list[TokenLogprobs]]] = field(default_factory=list)
    # speculative decoding: per sequence that had drafts, how many the step rejected
    num_rejected: dict[Sequence, int] = field(default_factory=dict)
    # embedding requests whose prompt the step finished: (sequence, embedding on the CPU)
    pooled: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the step accepts: those up to the first that differs from the token
    sampled at its position. The model's token at the first difference (or after the last
    draft) follows them, so every output token is one the model sampled given the tokens
    before it: greedy outputs equal plain decoding's, and sampled ones follow the same
    distribution (for a proposal of one certain token, rejection sampling reduces to this
    comparison)."""
    count = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        count += 1
    return count


class LaunchedStep:
    def __init__(self, inputs: ModelInputs, sampled: SamplerOutput | None = None,
                 prompt_logprobs: list[tuple[PromptRows, list[TokenLogprobs]]] | None = None,
                 generator_states: dict[Sequence, torch.Tensor] | None = None,
                 pooled: list[tuple[Sequence, torch.Tensor]] | None = None):
        self.inputs = inputs
        self.pooled = pooled or []
        # speculative decoding: seeded sequences' generator states before this step's draws
        self.generator_states = generator_states or {}
        self.sampled = sampled  # its logprobs stay on the device until result()
        token_ids = None if sampled is None else sampled.token_ids
        self.token_ids = token_ids  # [sampled rows], on the device: the next step's inputs
        self.prompt_logprobs = prompt_logprobs or []
        self.ready: torch.cuda.Event | None = None
        self.host_token_ids = token_ids
        if token_ids is not None and token_ids.is_cuda:
            self.host_token_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self.host_token_ids.copy_(token_ids, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    @property
    def sampled_index(self) -> dict[Sequence, int]:
        """Each sampling sequence's row in `token_ids` (async scheduling, which runs
        without drafts: one row per sequence)."""
        return {item.seq: i for i, item in enumerate(self.inputs.sampled_rows)}

    def result(self) -> StepResult:
        """The sampled tokens on the host (waits for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.host_token_ids is None:
            return StepResult(prompt_logprobs=self.prompt_logprobs,
                              pooled=[(seq, vector.cpu()) for seq, vector in self.pooled])
        tokens, logprobs, beams = self.host_token_ids.tolist(), self.sampled.logprobs, self.sampled.beam_candidates
        result = StepResult(prompt_logprobs=self.prompt_logprobs)
        row = 0
        for item in self.inputs.sampled_rows:
            drafts = item.draft_token_ids
            count = num_accepted(drafts, tokens[row:row + len(drafts)]) if drafts else 0
            result.samples += [SampledToken(item, tokens[r], logprobs[r], beams[r])
                               for r in range(row, row + count + 1)]
            if drafts:
                result.num_rejected[item.seq] = len(drafts) - count
                state = self.generator_states.get(item.seq)
                if state is not None:
                    rewind_draws(item.seq.generator, state, count + 1)
            row += len(drafts) + 1
        return result
