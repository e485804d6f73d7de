"""Per-request sampling parameters, validated at construction.

Names follow vLLM where vLLM has the parameter (`n`, `best_of`, `logprobs`, `min_tokens`,
`stop`, ...) and TGI where only TGI has it (`typical_p`, `do_sample`). `max_new_tokens` is
the primary name of the length limit and `max_tokens` an alias; `min_new_tokens` is an
alias of `min_tokens`. Every invalid value raises `SamplingParamsError` naming the field
and the allowed range, so the server can hand the message to the client as it is.
"""
from __future__ import annotations

import math
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.sampling.structured import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
LOGIT_BIAS_RANGE = 100.0         # OpenAI: [-100, 100]
PENALTY_RANGE = 2.0              # OpenAI frequency / presence penalty: [-2, 2]


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the range."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# max_new_tokens of a request that runs until its sequence fills the context (max_model_len)
UNTIL_CONTEXT_ENDS = 2 ** 62


@dataclass
class SamplingParams:
    """How to choose the tokens of one request.

    Greedy or sampled: with `do_sample=None` (the default, vLLM's rule) `temperature=0`
    means greedy and anything else samples. `do_sample=True` always samples;
    `do_sample=False` is greedy unless a warper is set (temperature != 1, top_k, top_p,
    typical_p, min_p), which is TGI's rule. Penalties, `logit_bias` and `min_tokens` apply
    to greedy rows too. `top_k=0` (or -1), `top_p=1`, `min_p=0`, `typical_p=1` and the
    neutral penalties disable those processors.
    """

    max_new_tokens: int | None = 16     # `max_tokens` is an alias; None: until the context is full (vLLM)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    do_sample: bool | None = None
    repetition_penalty: float = 1.0     # HF / TGI: over prompt and output tokens
    frequency_penalty: float = 0.0      # OpenAI: over output tokens, times their count
    presence_penalty: float = 0.0       # OpenAI: over output tokens present at all
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    n: int = 1
    best_of: int | None = None          # None: n; else run best_of, keep the n best by cumulative logprob
    min_tokens: int = 0                 # `min_new_tokens` is an alias
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None         # alternatives per generated token (0: the chosen only)
    prompt_logprobs: int | None = None  # alternatives per prompt token (0: the prompt token only)
    # JSON schema / regex / choice / grammar the output must follow (sampling/structured.py);
    # a dict of StructuredOutputsParams' fields is taken too
    structured_outputs: StructuredOutputsParams | None = None
    # a reasoning model's end-of-thinking token (e.g. </think>): the constraint above
    # applies only to what follows it, the reasoning before it is free (None: from the start)
    reasoning_end_token_id: int | None = None
    # its opening token (e.g. <think>) where the output may or may not open the reasoning:
    # the first token is then that one (the reasoning follows) or the constraint's own
    # (None: the output starts inside the reasoning)
    reasoning_start_token_id: int | None = None
    # the most tokens the reasoning may take (vLLM's thinking_token_budget): then its end
    # token (reasoning_end_token_id) is forced and the answer follows (None: no limit)
    thinking_token_budget: int | None = None
    # TGI: bias each step's green list, the engine's WatermarkConfig (sampling/watermark.py)
    watermark: bool = False
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # beam search (engine/beam_search.py): best_of (else n) beams, the n best returned;
    # hypotheses are ranked by cumulative logprob / generated length ** length_penalty, and
    # early_stopping (true, false or "never") is transformers' rule for when to stop
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    bad_words: list[str] | None = None          # vLLM's: words kept out of the output
    # the engine's tokenization of bad_words (sampling/bad_words.py), set as a request arrives
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamsError:
            return SamplingParamsError(f"`{name}` {rule}, got {getattr(self, name)!r}")

        if self.max_new_tokens is None:
            self.max_new_tokens = UNTIL_CONTEXT_ENDS
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_new_tokens={self.max_new_tokens}]")

        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:  # also NaN
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.top_k == -1:  # vLLM spelling of "disabled"
            self.top_k = 0
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1] (1 disables it)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1] (0 disables it)")
        if not _is_number(self.typical_p) or not 0.0 < self.typical_p <= 1.0:
            raise bad("typical_p", "must be in (0, 1] (1 disables it)")
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise bad("do_sample", "must be true, false or null")
        if self.do_sample and self.temperature < GREEDY_TEMPERATURE:
            raise bad("temperature", "must be strictly positive when `do_sample` is true")

        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise bad(name, f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 disables it)")
        self.logit_bias = self._check_logit_bias()

        if self.seed is not None and (not _is_int(self.seed)
                                      or not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise bad("seed", "must be an integer in [-2**63, 2**64)")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"must be null or an integer >= n ({self.n})")
        self._check_beam_search()
        if self.num_sequences > 1 and self.greedy and not self.use_beam_search:
            name = "best_of" if self.num_sequences > self.n else "n"
            raise bad(name, "must be 1 when decoding is greedy (set temperature > 0 or do_sample)")

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "watermark"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        self.stop = self._check_stop()
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, "must be null or an integer >= 0 (how many alternatives)")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be null or a non-empty list of token ids >= 0")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise bad("bad_words", "must be null or a list of non-blank strings")
        self.structured_outputs = self._check_structured_outputs()
        for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, "must be null or a token id >= 0")
        if self.thinking_token_budget is not None:
            if not _is_int(self.thinking_token_budget) or self.thinking_token_budget < 0:
                raise bad("thinking_token_budget", "must be null or an integer >= 0")
            if self.reasoning_end_token_id is None:
                raise bad("thinking_token_budget", "needs `reasoning_end_token_id` (the token that ends the reasoning)")
        if self.reasoning_end_token_id is not None and self.structured_outputs is None \
                and self.thinking_token_budget is None:
            raise bad("reasoning_end_token_id", "applies to structured outputs or a thinking budget: set "
                      "`structured_outputs` or `thinking_token_budget` too, or leave it null")
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise bad("reasoning_start_token_id", "needs `reasoning_end_token_id` (where the reasoning ends)")

    def _check_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise SamplingParamsError(f"`use_beam_search` must be true or false, got {self.use_beam_search!r}")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise SamplingParamsError(f"`length_penalty` must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise SamplingParamsError(f"`early_stopping` must be true, false or \"never\", got {self.early_stopping!r}")
        if not self.use_beam_search:
            return
        # what beam search cannot honour: a sampled or constrained token is not a ranked
        # candidate, and a watermark has nothing to draw
        unsupported = {"structured outputs (`structured_outputs`, `response_format`, guided decoding, "
                       "a forced tool call)": self.structured_outputs is not None,
                       "`thinking_token_budget`": self.thinking_token_budget is not None,
                       "`do_sample`": self.do_sample is True, "`watermark`": self.watermark is True}
        for what, given in unsupported.items():
            if given:
                raise SamplingParamsError(f"{what} cannot be used with beam search (`use_beam_search`)")

    def _check_structured_outputs(self) -> StructuredOutputsParams | None:
        from tessera.sampling.structured import KINDS, StructuredOutputsParams

        spec = self.structured_outputs
        if spec is None or isinstance(spec, StructuredOutputsParams):
            return spec
        if not isinstance(spec, dict) or not set(spec) <= set(KINDS):
            raise SamplingParamsError(f"`structured_outputs` takes {', '.join(KINDS)}; got {spec!r}")
        return StructuredOutputsParams(**spec)

    def _check_logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError(f"`logit_bias` must be a mapping of token id to bias, "
                                      f"got {self.logit_bias!r}")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key  # JSON keys
            if not _is_int(token) or token < 0:
                raise SamplingParamsError(f"`logit_bias` keys must be token ids >= 0, got {key!r}")
            if not _is_number(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise SamplingParamsError(f"`logit_bias` values must be in [-{LOGIT_BIAS_RANGE:g}, "
                                          f"{LOGIT_BIAS_RANGE:g}], got {value!r} for token {key!r}")
            bias[token] = float(value)
        return bias or None

    def _check_stop(self) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(f"`stop` must be a string or a list of non-empty strings, "
                                      f"got {self.stop!r}")
        return list(stop)

    # --- what the sampler needs to know -----------------------------------------------------

    @property
    def has_warpers(self) -> bool:
        return (self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0
                or self.typical_p < 1.0 or self.min_p > 0.0)

    @property
    def greedy(self) -> bool:
        if self.use_beam_search:  # (its rows' candidates are ranked, not drawn: no warpers)
            return True
        if self.do_sample is False and not self.has_warpers:
            return True
        # Below this, logits / T overflows; the distribution is a point mass anyway.
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the tokens sampled so far (penalties count them; min_tokens
        counts the output; a grammar advances with each; the last seeds the watermark; bad
        words match its end; a thinking budget counts the reasoning; beam search picks each
        beam's token on the host), so a step cannot be launched before the last one's reach
        the host."""
        return (self.has_penalties or self.min_tokens > 0 or self.structured_outputs is not None
                or self.use_beam_search
                or self.watermark or bool(self.bad_words_token_ids) or self.thinking_token_budget is not None)

    @property
    def num_sequences(self) -> int:
        """How many sequences the request runs: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_logprobs(self) -> bool:
        """Whether the chosen token's logprob is computed (asked for, or to rank best_of)."""
        return self.logprobs is not None or (self.num_sequences > self.n and not self.use_beam_search)

    @property
    def beam_width(self) -> int:
        """How many beams the search keeps (0: no beam search)."""
        return self.num_sequences if self.use_beam_search else 0

    def beam_candidates(self, num_eos: int) -> int:
        """How many candidates a beam search keeps a step (transformers' count): (1 + the
        tokens that end a beam, at least 2) x the width, so that `width` can go on however
        many of them end."""
        ends = (0 if self.ignore_eos else num_eos) + len(self.stop_token_ids)
        return max(2, 1 + ends) * self.beam_width

    def child_seed(self, index: int) -> int | None:
        """The seed of the request's `index`-th sequence (n / best_of): seed + index."""
        return None if self.seed is None else (self.seed + index) % 2**64


def _accept_aliases(cls, aliases: dict[str, str]):
    """Let the constructor take `alias=value` for a field and read it back as a property;
    the aliases are not fields, so repr, ==, and dataclasses.replace see only the
    primary names. Giving both with different values is an error; an invalid value is
    reported under the name the caller used."""
    init = cls.__init__
    names = [f for f in cls.__dataclass_fields__]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        used = {}
        for alias, name in aliases.items():
            if alias not in kwargs:
                continue
            used[name] = alias
            value = kwargs.pop(alias)
            positional = names.index(name) < len(args)
            given = args[names.index(name)] if positional else kwargs.get(name)
            if value is not None and given is not None and given != value:
                raise SamplingParamsError(f"`{name}` and its alias `{alias}` disagree: {given!r} != {value!r}")
            if (value is not None or alias == "max_tokens") and not positional and name not in kwargs:
                kwargs[name] = value  # vLLM's max_tokens=None: until the context is full
        try:
            init(self, *args, **kwargs)
        except SamplingParamsError as exc:  # name the field as the caller spelled it
            message = str(exc)
            for name, alias in used.items():
                if message.startswith(f"`{name}` "):
                    raise SamplingParamsError(f"`{alias}`" + message[len(name) + 2:]) from None
            raise

    cls.__init__ = __init__
    for alias, name in aliases.items():
        setattr(cls, alias, property(lambda self, name=name: getattr(self, name), doc=f"alias of {name}"))
    return cls


_accept_aliases(SamplingParams, {"max_tokens": "max_new_tokens", "min_new_tokens": "min_tokens"})
