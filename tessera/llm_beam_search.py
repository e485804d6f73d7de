"""LLM.beam_search, vLLM's offline beam search call and its types, over the engine's beam
search (SamplingParams(use_beam_search=True), engine/beam_search.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tessera.engine.outputs import PositionLogprobs, RequestOutput
from tessera.sampling.params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's: `beam_width` beams, each at most `max_tokens` new tokens. `temperature` is
    taken for vLLM's signature and ignored (beams are ranked, not drawn, as in vLLM)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(use_beam_search=True, n=self.beam_width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output)


@dataclass
class BeamSearchSequence:
    """One beam as vLLM returns it: `tokens` and `text` hold the prompt and the output."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class BeamSearchMethods:
    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """One BeamSearchOutput per prompt (a string, token ids, or vLLM's dict forms), its
        `beam_width` beams best first."""
        outputs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return [_as_vllm(out, self.get_tokenizer()) for out in outputs]


def _as_vllm(out: RequestOutput, tokenizer) -> BeamSearchOutput:
    """vLLM's shape: each beam's tokens are the prompt's and its own, its text all of them
    decoded (special tokens kept, as vLLM's decode keeps them)."""
    sequences = []
    for c in out.outputs:
        tokens = list(out.prompt_token_ids) + list(c.token_ids)
        sequences.append(BeamSearchSequence(tokens, c.cumulative_logprob, tokenizer.decode(tokens),
                                            c.finish_reason, c.stop_reason, list(c.logprobs or [])))
    return BeamSearchOutput(sequences)
