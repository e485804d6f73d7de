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
from tessera.sampling.sampler import SamplerOutput, TokenLogprobs


@dataclass
class SampledToken:
    item: ScheduledSeq
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class StepResult:
    samples: list[SampledToken] = field(default_factory=list)
    # per sequence asking for prompt logprobs: its rows and their logprobs, in position order
    prompt_logprobs: list[tuple[PromptRows, list[TokenLogprobs]]] = field(default_factory=list)


class LaunchedStep:
    def __init__(self, inputs: ModelInputs, sampled: SamplerOutput | None = None,
                 prompt_logprobs: list[tuple[PromptRows, list[TokenLogprobs]]] | None = None):
        self.inputs = inputs
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
        """Each sampling sequence's row in `token_ids`."""
        return {item.seq: i for i, item in enumerate(self.inputs.sampled_rows)}

    def result(self) -> StepResult:
        """The sampled tokens on the host (waits for the device)."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.host_token_ids is None:
            return StepResult(prompt_logprobs=self.prompt_logprobs)
        samples = [SampledToken(item, token, lp) for item, token, lp
                   in zip(self.inputs.sampled_rows, self.host_token_ids.tolist(), self.sampled.logprobs)]
        return StepResult(samples, self.prompt_logprobs)
