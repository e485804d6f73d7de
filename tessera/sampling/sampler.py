"""Batched next-token choice for rows with different parameters.

One step, for a [B, V] float32 logits tensor:

1. structured-output masks (tokens a row's grammar does not allow next at -inf), then
   logit_bias, then min_tokens (EOS and stop token ids at -inf while a row is short of its
   minimum), then the watermark's green-list bias (before penalties, as TGI), then
   penalties: repetition (HF: prompt and output tokens), frequency and presence (OpenAI:
   output tokens), then a forced token (a spent thinking budget's end of reasoning) alone
   left. These apply to greedy rows too.
2. Greedy rows take the argmax. Sampled rows go through temperature, top-k, top-p, min-p
   and typical-p (HF's order) and draw by inverting their CDF at one uniform from the
   row's own generator (seeded requests) or the engine's, so a seeded request samples the
   same tokens whatever else shares the batch. (One uniform per row instead of an
   exponential race's one per vocabulary entry: 13 ms instead of 71 ms for 64 rows of a
   49k vocabulary on one CPU thread, and seeded rows need no per-row pass over the
   vocabulary.)
3. For rows that want them: the chosen token's logprob, its rank and the top-n
   alternatives. By default these come from the raw model distribution, before any
   processing (vLLM's default `raw_logprobs`); `logprobs_mode="processed"` takes them from
   the distribution actually sampled from (after penalties, temperature and filters;
   TGI's behaviour), where filtered-out tokens have logprob -inf.

Every processor runs only when some row needs it, on all rows at once; per-row
parameters become tensors once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tessera.platform import to_device
from tessera.sampling import processors as P
from tessera.sampling.bad_words import banned_next_tokens
from tessera.sampling.params import SamplingParams
from tessera.sampling.structured import mask_logits
from tessera.sampling.watermark import GreenLists, WatermarkConfig, apply_watermark

LOGPROBS_MODES = ("raw", "processed")


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row; None: the engine's shared generator
    # Per row: the sequence's token ids (prompt then output; referenced, not copied) and
    # how many of them are prompt. Needed only for penalties and min_tokens.
    token_ids: list[list[int]] | None = None
    num_prompt_tokens: list[int] | None = None
    # per row: its structured-output matcher, or None (sampling/structured.py)
    grammars: list | None = None
    # speculative decoding: per row, draft tokens that follow token_ids at this row's
    # position (the row verifying a sequence's j-th draft sees its first j - 1)
    draft_token_ids: list[list[int]] | None = None
    # per row: a token it must take whatever the logits say (a thinking budget spent), or None
    forced_token_ids: list[int | None] | None = None

    def output_ids(self, row: int) -> list[int]:
        if self.token_ids is None:
            return []
        return self.token_ids[row][self.num_prompt_tokens[row]:] + self._drafts(row)

    def all_ids(self, row: int) -> list[int]:
        if self.token_ids is None:
            return []
        drafts = self._drafts(row)
        return self.token_ids[row] + drafts if drafts else self.token_ids[row]

    def last_id(self, row: int) -> int:
        """The token this row's next one follows (its last draft, when it verifies one)."""
        drafts = self._drafts(row)
        return drafts[-1] if drafts else self.token_ids[row][-1]

    def _drafts(self, row: int) -> list[int]:
        return [] if self.draft_token_ids is None else self.draft_token_ids[row]

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch of these rows only."""
        def pick(values: list | None) -> list | None:
            return None if values is None else [values[i] for i in rows]

        return SamplingBatch(pick(self.params), pick(self.generators), pick(self.token_ids),
                             pick(self.num_prompt_tokens), pick(self.grammars), pick(self.draft_token_ids),
                             pick(self.forced_token_ids))


@dataclass
class TokenLogprobs:
    """Logprob information for one position: the chosen (or prompt) token, its rank (1 =
    most likely) and the top-n alternatives, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


class LogprobTensors:
    """Logprob information of some rows, still on the device: computed with the step, read
    on the host only when asked (async scheduling launches the next step before that)."""

    def __init__(self, logprobs: torch.Tensor, chosen: torch.Tensor, num_top: Sequence[int]):
        """logprobs [R, V] (log_softmax'ed), chosen [R]; one topk for all rows."""
        self.chosen = chosen
        self.chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        self.ranks = (logprobs > self.chosen_lp.unsqueeze(1)).sum(dim=1).add_(1)
        self.num_top = list(num_top)
        k = min(max(self.num_top, default=0), logprobs.shape[1])
        self.top = logprobs.topk(k, dim=1) if k > 0 else None

    def to_host(self) -> list[TokenLogprobs]:
        """Per row the chosen token's logprob, rank and its `num_top[r]` best alternatives."""
        top_ids: list[list[int]] = [[] for _ in self.num_top]
        top_lps: list[list[float]] = [[] for _ in self.num_top]
        if self.top is not None:
            top_ids, top_lps = self.top.indices.tolist(), self.top.values.tolist()
        return [TokenLogprobs(t, lp, r, list(zip(ids[:n], lps[:n])))
                for t, lp, r, ids, lps, n in zip(self.chosen.tolist(), self.chosen_lp.tolist(),
                                                 self.ranks.tolist(), top_ids, top_lps, self.num_top)]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima; a NaN counts as the largest), as
    torch.argmax gives it: torch.max's indices are the same and faster on CPU ([32, 49152]
    float32: 0.94 vs 1.52 ms; one row 58 vs 92 us, on the 2-core Xeon of docs/benchmarks.md)."""
    return logits.max(dim=-1).indices


def logprob_info(logprobs: torch.Tensor, chosen: torch.Tensor,
                 num_top: Sequence[int]) -> list[TokenLogprobs]:
    """logprobs [R, V] (log_softmax'ed), chosen [R] -> per row the chosen token's logprob,
    rank and its `num_top[r]` best alternatives."""
    return LogprobTensors(logprobs, chosen, num_top).to_host()


class SamplerOutput:
    """The chosen tokens [B] (int64, on the logits' device) and, per row that asked, their
    logprobs, read on the host the first time `logprobs` is used."""

    def __init__(self, token_ids: torch.Tensor, pending: tuple[list[int], LogprobTensors] | None = None,
                 beams: tuple[list[int], LogprobTensors] | None = None):
        self.token_ids = token_ids
        self._logprobs: list[TokenLogprobs | None] | None = None
        self._pending = pending  # (rows, their logprob tensors)
        self._beam_candidates: list[TokenLogprobs | None] | None = None
        self._beams = beams  # beam search rows: (rows, their candidates' tensors)

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        if self._logprobs is None:
            self._logprobs = _per_row(self._pending, self.token_ids.shape[0])
        return self._logprobs

    @property
    def beam_candidates(self) -> list[TokenLogprobs | None]:
        """Per beam search row, its best next tokens (`top`, best first) by processed logprob."""
        if self._beam_candidates is None:
            self._beam_candidates = _per_row(self._beams, self.token_ids.shape[0])
        return self._beam_candidates


def _per_row(pending: tuple[list[int], LogprobTensors] | None, num_rows: int) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * num_rows
    if pending is not None:
        rows, tensors = pending
        for i, item in zip(rows, tensors.to_host()):
            out[i] = item
    return out


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 logprobs_mode: str = "raw", top_p_prefix: int | None = 256,
                 watermark: WatermarkConfig | None = None):
        """`top_p_prefix`: how many best tokens top-p sorts before falling back to the whole
        vocabulary (see processors.apply_top_p); None sorts everything without a check that
        waits for the device. `watermark`: the green lists of rows that ask for one."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.top_p_prefix = top_p_prefix
        self.watermark = watermark or WatermarkConfig()
        self._green: GreenLists | None = None  # made for the logits' vocabulary on first use
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = sorted(eos_token_ids)
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: [B, V] float32 -> chosen token ids [B] (int64, on the logits' device)."""
        return self.sample(logits, batch).token_ids

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        params = batch.params
        x = self._preprocess(logits, batch)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            chosen = greedy_ids(x)
            warped = None
        else:
            chosen, warped = self._sample_rows(x, batch, sampled_rows)
        return SamplerOutput(chosen, pending=self._logprobs(logits, x, warped, sampled_rows, chosen, params),
                             beams=self._beam_candidates(logits, chosen, batch))

    # --- the steps --------------------------------------------------------------------------

    def _preprocess(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The structured-output masks, logit_bias, min_tokens and penalties; returns
        `logits` itself if none applies."""
        params = batch.params
        x = constrained = logits
        if batch.grammars is not None and any(g is not None for g in batch.grammars):
            x = constrained = mask_logits(x, batch.grammars)
        if any(p.logit_bias for p in params):
            rows, ids, bias = [], [], []
            for i, p in enumerate(params):
                for token, value in (p.logit_bias or {}).items():
                    rows.append(i)
                    ids.append(token)
                    bias.append(value)
            x = P.apply_logit_bias(x, rows, ids, bias)
        if any(p.allowed_token_ids for p in params):
            x = P.allow_only(x, {i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids})
        if any(p.bad_words_token_ids for p in params):
            rows, ids = [], []
            for i, p in enumerate(params):
                banned = banned_next_tokens(p.bad_words_token_ids or (), batch.output_ids(i))
                rows.extend([i] * len(banned))
                ids.extend(banned)
            if rows:
                x = P.suppress_tokens(x, rows, ids)
        if any(p.min_tokens for p in params):
            rows, ids = [], []
            for i, p in enumerate(params):
                if p.min_tokens and len(batch.output_ids(i)) < p.min_tokens:
                    stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                    rows.extend([i] * len(stops))
                    ids.extend(stops)
            if rows:
                x = P.suppress_tokens(x, rows, ids)
        marked = [i for i, p in enumerate(params) if p.watermark]
        if marked:
            x = x.clone() if x is logits else x
            x = apply_watermark(x, marked, [batch.last_id(i) for i in marked],
                                self._green_lists(x.shape[1]))
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            x = x.clone() if x is logits else x
            x[penalised] = self._penalise(x[penalised], batch, penalised)
        if constrained is not logits and x is not constrained:
            # where min_tokens took the only tokens a constraint allows (its end), the
            # constraint wins: its output is complete (no host sync: a where over rows)
            x = torch.where(torch.isinf(x).all(dim=1, keepdim=True), constrained, x)
        forced = [(i, t) for i, t in enumerate(batch.forced_token_ids or ()) if t is not None]
        if forced:  # last: nothing before may keep it from being taken
            x = P.force_tokens(x, [i for i, _ in forced], [t for _, t in forced])
        return x

    def _green_lists(self, vocab_size: int) -> GreenLists:
        if self._green is None or self._green.vocab_size != vocab_size:
            self._green = GreenLists(self.watermark, vocab_size)
        return self._green

    def _penalise(self, x: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        params = [batch.params[i] for i in rows]
        vocab, device = x.shape[1], x.device

        def column(name: str) -> torch.Tensor:
            return P.device_tensor([getattr(p, name) for p in params], device, x.dtype)

        if any(p.repetition_penalty != 1.0 for p in params):
            seen = P.token_counts([batch.all_ids(i) for i in rows], vocab, device) > 0
            x = P.apply_repetition_penalty(x, seen, column("repetition_penalty"))
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            counts = P.token_counts([batch.output_ids(i) for i in rows], vocab, device)
            x = P.apply_frequency_presence_penalties(x, counts, column("frequency_penalty"),
                                                     column("presence_penalty"))
        return x

    def _sample_rows(self, x: torch.Tensor, batch: SamplingBatch,
                     rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Warp and draw the non-greedy rows; returns all rows' choices and the warped
        logits of the sampled rows."""
        params = [batch.params[i] for i in rows]
        device = x.device

        def column(name: str, dtype: torch.dtype = x.dtype) -> torch.Tensor:
            return P.device_tensor([getattr(p, name) for p in params], device, dtype)

        every_row = len(rows) == x.shape[0]
        index = None if every_row else P.device_tensor(rows, device)
        y = P.apply_temperature(x if every_row else x.index_select(0, index), column("temperature"))
        if any(p.top_k > 0 for p in params):
            y = P.apply_top_k(y, column("top_k", torch.long))
        if any(p.top_p < 1.0 for p in params):
            y = P.apply_top_p(y, column("top_p"), self.top_p_prefix)
        if any(p.min_p > 0.0 for p in params):
            y = P.apply_min_p(y, column("min_p"))
        if any(p.typical_p < 1.0 for p in params):
            y = P.apply_typical_p(y, column("typical_p"))
        sampled = self._draw(y.softmax(dim=-1), [batch.generators[i] for i in rows])
        if every_row:
            return sampled, y
        return greedy_ids(x).index_copy_(0, index, sampled), y

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One uniform per row from the row's own generator, or the engine's."""
        uniforms = torch.empty(probs.shape[0], dtype=torch.float64)
        shared = [j for j, g in enumerate(generators) if g is None]
        if shared:
            uniforms[shared] = torch.rand(len(shared), dtype=torch.float64, generator=self.generator)
        for j, gen in enumerate(generators):
            if gen is not None:
                uniforms[j] = _own_uniform(gen)
        return inverse_cdf(probs, to_device(uniforms, probs.device))

    def _beam_candidates(self, logits: torch.Tensor, chosen: torch.Tensor,
                         batch: SamplingBatch) -> tuple[list[int], LogprobTensors] | None:
        """Beam search rows' candidates, scored as transformers' beam search scores them:
        the log_softmax of the logits, then the processors (penalties, logit_bias, min_tokens:
        no renormalizing; no warpers). As many as the search keeps a step
        (SamplingParams.beam_candidates), or more where `logprobs` asks for more alternatives."""
        params = batch.params
        rows = [i for i, p in enumerate(params) if p.use_beam_search]
        if not rows:
            return None
        index = P.device_tensor(rows, logits.device)
        scores = self._preprocess(logits.index_select(0, index).log_softmax(dim=-1), batch.select(rows))
        wanted = [max(params[i].beam_candidates(len(self.eos_token_ids)), params[i].logprobs or 0) for i in rows]
        return rows, LogprobTensors(scores, chosen.index_select(0, index), wanted)

    def _logprobs(self, raw: torch.Tensor, x: torch.Tensor, warped: torch.Tensor | None,
                  sampled_rows: list[int], chosen: torch.Tensor,
                  params: list[SamplingParams]) -> tuple[list[int], LogprobTensors] | None:
        """The rows that want logprobs and their logprob tensors (left on the device)."""
        rows = [i for i, p in enumerate(params) if p.needs_logprobs]
        if not rows:
            return None
        device = raw.device
        index = P.device_tensor(rows, device)
        if self.logprobs_mode == "raw":
            source = raw.index_select(0, index)
        else:  # the distribution each row was chosen from
            source = x.index_select(0, index)
            if warped is not None:
                position = {i: j for j, i in enumerate(sampled_rows)}
                mine = [k for k, i in enumerate(rows) if i in position]
                if mine:
                    source.index_copy_(0, P.device_tensor(mine, device), warped.index_select(
                        0, P.device_tensor([position[rows[k]] for k in mine], device)))
        return rows, LogprobTensors(source.log_softmax(dim=-1), chosen.index_select(0, index),
                                    [params[i].logprobs or 0 for i in rows])


def _own_uniform(generator: torch.Generator) -> torch.Tensor:
    """A seeded row's draw for one sampled token."""
    return torch.rand(1, dtype=torch.float64, generator=generator)


def rewind_draws(generator: torch.Generator, state: torch.Tensor, num_tokens: int) -> None:
    """Put a seeded sequence's generator where `num_tokens` sampled tokens from `state`
    leave it. Speculative decoding draws for every verified position, then keeps fewer
    tokens; rewinding makes the next draws those plain decoding would make, so a seeded
    request's output does not depend on what was drafted (nor on the rest of the batch)."""
    generator.set_state(state)
    for _ in range(num_tokens):
        _own_uniform(generator)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row r's token whose CDF interval holds uniforms[r] (in [0, 1)). The CDF is summed in
    float64, so even 1e-12 probabilities keep their share; a token of probability 0 is
    never chosen (rounding at the top end falls back to the last possible token)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)
    last_possible = torch.searchsorted(cdf, total)  # where the CDF reaches its total
    return torch.minimum(chosen, last_possible).squeeze(1)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor,
                    num_top: Sequence[int], chunk: int = 128) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens: row r of `logits` predicts `next_token_ids[r]`. Always
    from the raw model distribution (no sampling parameters apply to the prompt). Done
    `chunk` rows at a time, so a long prompt chunk adds no second [rows, V] tensor."""
    out: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], chunk):
        end = start + chunk
        out += logprob_info(logits[start:end].log_softmax(dim=-1), next_token_ids[start:end],
                            num_top[start:end])
    return out
