"""Rotary position embedding (rotate-half layout, as Hugging Face checkpoints store q/k).

cos/sin are precomputed for every position up to max_position once; each step gathers rows
by position once, so a batch mixing prefill and decode needs no special casing.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tessera.ops.module import OpModule
from tessera.ops.registry import OpTarget, register_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "longrope", "llama3", "proportional")
# Kinds whose frequencies depend on the current sequence length (transformers'
# dynamic_rope_update): computed per token from that token's own sequence length.
LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(config: Any) -> dict:
    """rope_theta and scaling as one dict, from either transformers 5 (`rope_parameters`)
    or 4 (`rope_theta` + `rope_scaling`) style configs, plus the lengths some kinds need."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    params.setdefault("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    factors = getattr(config, "rope_freq_factors", None)  # from a GGUF's rope_freqs (gguf_rope.py)
    if factors is not None:
        params["freq_factors"] = list(factors)
    if params.get("original_max_position_embeddings") is None:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
    return params


def _plain_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(dim: int, params: dict) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:  # Phi-3's default: grows with the extension ratio
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if ext.shape != shape.shape:  # one factor per rotary frequency, or a silent broadcast
        raise ValueError(f"longrope: {ext.numel()} {'long' if long else 'short'} factors for "
                         f"{shape.numel()} frequencies (rotary dimension {dim})")
    return 1.0 / (ext * float(params["rope_theta"]) ** shape), float(attention)


def _proportional(dim: int, params: dict) -> torch.Tensor:
    """Gemma 4's full-attention rope: the first partial_rotary_factor of the head's
    frequency pairs turn at base^(2i / head_dim) (the whole head's spacing, not the rotated
    part's), the rest have frequency 0 and pass through unturned."""
    turned = int(float(params.get("partial_rotary_factor", 1.0)) * dim // 2)
    inv_freq = torch.zeros(dim // 2, dtype=torch.float32)
    inv_freq[:turned] = 1.0 / (float(params["rope_theta"])
                               ** (torch.arange(0, 2 * turned, 2, dtype=torch.int64).float() / dim))
    return inv_freq / float(params.get("factor", 1.0))


def rope_frequencies(rotary_dim: int, params: dict,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling of cos/sin), as transformers' ROPE_INIT_FUNCTIONS return
    them. `seq_len` (the sequence's current length) matters only for LENGTH_DEPENDENT kinds.
    `freq_factors` (llama.cpp's rope_freqs: Llama 3.1's scaling as one divisor per
    frequency) divide the kind's frequencies, as llama.cpp's rope does."""
    inv_freq, scale = _kind_frequencies(rotary_dim, params, seq_len)
    factors = params.get("freq_factors")
    if factors is None:
        return inv_freq, scale
    if len(factors) != inv_freq.numel():
        raise ValueError(f"rope frequency factors: {len(factors)} values for {inv_freq.numel()} "
                         f"frequencies (rotary dimension {rotary_dim})")
    return inv_freq / torch.tensor(factors, dtype=torch.float32), scale


def _kind_frequencies(rotary_dim: int, params: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    if kind == "default":
        return _plain_inv_freq(rotary_dim, base), 1.0
    if kind == "linear":
        return _plain_inv_freq(rotary_dim, base) / float(params["factor"]), 1.0
    if kind == "dynamic":  # NTK: the base grows once the sequence outgrows the trained length
        trained = params["max_position_embeddings"]
        length = max(seq_len or trained, trained)
        factor = float(params["factor"])
        base = base * ((factor * length / trained) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _plain_inv_freq(rotary_dim, base), 1.0
    if kind == "ntk":  # fixed NTK (GTE v1.5's remote code): a larger base, every frequency divided alike
        factor = float(params["factor"])
        return _plain_inv_freq(rotary_dim, base * factor) / factor ** (2 / rotary_dim), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, params)
    if kind == "longrope":
        return _longrope(rotary_dim, params, seq_len)
    if kind == "proportional":
        return _proportional(rotary_dim, params), 1.0
    if kind == "llama3":
        inv_freq = _plain_inv_freq(rotary_dim, base)
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def inverse_frequencies(rotary_dim: int, params: dict) -> torch.Tensor:
    return rope_frequencies(rotary_dim, params)[0]


def rope_context_length(params: dict) -> int | None:
    """The context rope scaling stretches the model to, as vLLM derives it: factor x
    max_position_embeddings for linear and dynamic, factor x the original length for yarn;
    None where max_position_embeddings already is the scaled length (llama3, longrope) or
    nothing is scaled."""
    kind, factor = params.get("rope_type"), params.get("factor")
    if kind not in ("linear", "dynamic", "yarn") or not factor:
        return None
    base = params.get("original_max_position_embeddings" if kind == "yarn" else "max_position_embeddings")
    return int(base * float(factor)) if base else None


def length_threshold(params: dict) -> int:
    """Sequence length beyond which a LENGTH_DEPENDENT kind changes its frequencies."""
    key = "max_position_embeddings" if params["rope_type"] == "dynamic" else "original_max_position_embeddings"
    return int(params[key])


def token_seq_lens(positions: torch.Tensor) -> torch.Tensor:
    """Each token's sequence length after this step (its sequence's seq_len), from the
    runner's attention metadata; outside a forward pass, the tokens are one sequence."""
    from tessera.ops.attention.metadata import current_metadata

    try:
        md = current_metadata()
    except RuntimeError:
        return (positions.max() + 1).expand_as(positions)
    lens = torch.tensor(md.seq_lens_list, device=positions.device)
    lens = lens.repeat_interleave(torch.tensor(md.query_lens_list, device=positions.device))
    if lens.numel() != positions.numel():  # padded rows would shift every later token
        raise RuntimeError(f"{positions.numel()} positions but the metadata describes {lens.numel()} tokens")
    return lens


def _decodes_only() -> bool:
    """Whether this step's tokens are all decodes (each one its sequence's last position),
    from the host copies of the runner's metadata; False outside a forward pass."""
    from tessera.ops.attention.metadata import current_metadata

    try:
        md = current_metadata()
    except RuntimeError:
        return False
    return md.num_decodes == len(md.query_lens_list)


def _cos_sin_rows(freqs: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """[..., D / 2] angles -> [..., 2 D] rows (cos, cos, sin, sin): each step's cos and sin
    are then views of one gathered row, already repeated over both halves of the head.
    Scaled and cast to the model dtype as transformers does before applying them."""
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat((cos, cos, sin, sin), dim=-1) * scale).to(dtype)


@register_op("rotary", name="torch_rotary", priority=0)
def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_size: int, full_head: int | None = None,
               interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq*D], k: [T, Hk*D]; cos/sin: [T, 1, D] for these tokens' positions (D:
    head_size). `full_head` > head_size (partial rotary): the heads are that wide, only
    their first head_size dimensions turn, the rest pass through. `interleaved` (GLM-4,
    ERNIE, Cohere 2): the turned pairs are neighbours (2i, 2i + 1), not i and i + D / 2; the
    dimensions are gathered into halves (evens, then odds) around the rotation and back."""
    width = full_head or head_size
    order, back = _pair_order(head_size, q.device) if interleaved else (None, None)

    def apply(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, width)
        x = heads[..., :head_size] if order is None else heads[..., :head_size].index_select(-1, order)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        turned = x * cos + rotated * sin
        if back is not None:
            turned = turned.index_select(-1, back)
        return (turned if width == head_size else torch.cat((turned, heads[..., head_size:]), dim=-1)).flatten(1)

    return apply(q), apply(k)


@functools.lru_cache(maxsize=None)
def _pair_order(head_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved rotary's gather (evens, then odds) and its inverse, made once per size and
    device: not in every step (a CUDA graph cannot capture the host-to-device copy)."""
    order = torch.cat((torch.arange(0, head_size, 2), torch.arange(1, head_size, 2)))
    return order.to(device), torch.argsort(order).to(device)


class RotaryEmbedding(OpModule):
    """cos/sin for every position up to max_position, computed once; forward gathers the
    rows for one step's positions (once per step, shared by every layer).

    Length-dependent kinds follow transformers' dynamic_rope_update in a single-sequence
    generate: a token uses the frequencies for the length its sequence has after the step
    computing it (prompt length at prefill, position + 1 at decode), each sequence of a
    batch its own (never the batch maximum). longrope keeps a second (long-factor) table;
    dynamic computes cos/sin on the fly for sequences longer than max_position_embeddings
    (which the engine's max_model_len cap keeps it from reaching today). Keys already in the
    cache are never re-rotated, so results match transformers exactly only for sequences
    that do not cross the threshold after their first step: transformers' Phi-3 generate
    drops its cache and recomputes when a sequence crosses; a chunked prefill uses the
    length reached at each chunk's end; a prefix-cache hit reuses keys computed for
    another sequence's length.
    """

    def __init__(self, head_size: int, max_position: int, params: dict, target: OpTarget):
        super().__init__()
        self.params, self.dtype = params, target.dtype
        self.length_dependent = params["rope_type"] in LENGTH_DEPENDENT
        self._gather = target.op("embedding")  # rows of the table by position
        # positions up to the scaled context, where scaling stretches it past max_position
        max_position = max(max_position, rope_context_length(params) or 0)
        self.register_buffer("cos_sin", self._table(head_size, max_position, None, target),
                             persistent=False)
        if self.length_dependent:
            self.threshold = length_threshold(params)
            self.head_size = head_size
            if params["rope_type"] == "longrope":
                self.register_buffer("long_cos_sin", self._table(head_size, max_position,
                                                                 self.threshold + 1, target),
                                     persistent=False)
                # a position past the threshold is only ever in a long sequence: the short
                # table's rows there hold the long ones, so a decode token (its sequence
                # one longer than its position) needs one gather, no look at the lengths
                self.cos_sin[self.threshold:] = self.long_cos_sin[self.threshold:]

    def _table(self, head_size: int, max_position: int, seq_len: int | None,
               target: OpTarget) -> torch.Tensor:
        inv_freq, scale = rope_frequencies(head_size, self.params, seq_len)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        return _cos_sin_rows(freqs, scale, target.dtype).to(target.device)

    def _length_dependent_rows(self, positions: torch.Tensor) -> torch.Tensor:
        if self.params["rope_type"] == "longrope" and _decodes_only():
            return self._gather(positions, self.cos_sin)  # (CPU / CUDA graphs capture it)
        # dynamic may run past the table (sequences longer than it was trained for)
        rows = self.cos_sin.index_select(0, positions.clamp(max=self.cos_sin.shape[0] - 1))
        lens = token_seq_lens(positions)
        beyond = lens > self.threshold
        if not bool(beyond.any()):
            return rows
        if self.params["rope_type"] == "longrope":
            return torch.where(beyond.unsqueeze(1), self.long_cos_sin.index_select(0, positions), rows)
        rows = rows.clone()  # dynamic: one set of frequencies per sequence length
        for length in lens[beyond].unique().tolist():
            pick = lens == length
            inv_freq, scale = rope_frequencies(self.head_size, self.params, int(length))
            freqs = positions[pick].float().unsqueeze(1) * inv_freq.to(positions.device)
            rows[pick] = _cos_sin_rows(freqs, scale, rows.dtype)
        return rows

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = (self._length_dependent_rows(positions) if self.length_dependent
                else self._gather(positions, self.cos_sin))
        half = rows.shape[-1] // 2
        return rows[:, None, :half], rows[:, None, half:]  # views: [T, 1, D] each


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE): the frequencies come in three
    sections (`mrope_section`, summing to head_size / 2) that rotate by a token's temporal,
    height and width positions, as three blocks or (`interleaved`, Qwen3-VL) in turn. A text token has the same position in all three, which is
    plain rotary at that position; so a step passes 1-D positions, and only its image
    tokens' rows (`mrope_rows`) take their 3-D positions (`mrope_positions`, [3, rows])."""

    def __init__(self, head_size: int, max_position: int, params: dict, target: OpTarget,
                 mrope_section: list[int], interleaved: bool = False):
        if sum(mrope_section) != head_size // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_size / 2 = {head_size // 2}")
        super().__init__(head_size, max_position, params, target)
        if self.length_dependent:
            raise ValueError(f"M-RoPE with rope_type {params['rope_type']!r} is not supported")
        if interleaved:  # Qwen3-VL: frequencies cycle t, h, w while h and w last, then t alone
            j = torch.arange(head_size // 2)
            section = torch.where((j % 3 == 1) & (j < 3 * mrope_section[1]), 1,
                                  torch.where((j % 3 == 2) & (j < 3 * mrope_section[2]), 2, 0))
        else:  # Qwen2-VL: a block of t frequencies, then h, then w
            section = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        # the section of each column of a (cos, cos, sin, sin) row
        self.register_buffer("column_section", section.repeat(4).to(target.device), persistent=False)

    def forward(self, positions: torch.Tensor, mrope_rows: torch.Tensor | None = None,
                mrope_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._gather(positions, self.cos_sin)
        if mrope_rows is not None:
            t, h, w = (self.cos_sin.index_select(0, p) for p in mrope_positions)
            section = self.column_section
            mixed = torch.where(section == 0, t, torch.where(section == 1, h, w))
            rows = rows.index_copy(0, mrope_rows, mixed)
        half = rows.shape[-1] // 2
        return rows[:, None, :half], rows[:, None, half:]


class ApplyRotary(OpModule):
    """Rotary on every head of q and k. `rotary_dim` < head_size (partial rotary, as
    Phi-4-mini's partial_rotary_factor 0.75): only each head's first rotary_dim dimensions
    turn (the cos / sin are that wide), the rest pass through, as transformers does.
    `interleaved` (GLM-4, ERNIE, Cohere 2): the turned pairs are neighbours (2i, 2i + 1),
    not i and i + rotary_dim / 2. Both are arguments of the `rotary` op (rotary_ref)."""

    def __init__(self, head_size: int, target: OpTarget, rotary_dim: int | None = None, interleaved: bool = False):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        if self.rotary_dim % 2 or self.rotary_dim > head_size:
            raise ValueError(f"rotary over {self.rotary_dim} of {head_size} head dimensions: it must be even "
                             "and at most the head")
        self.interleaved = interleaved
        self._rotary = target.op("rotary", head_size=self.rotary_dim)

    @property
    def whole_heads(self) -> bool:
        """Whether the rotary turns whole heads in halves: what the fused rotary-and-cache-
        write op does (Attention.forward)."""
        return self.rotary_dim == self.head_size and not self.interleaved

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(q, k, rope[0], rope[1], self.rotary_dim, full_head=self.head_size,
                            interleaved=self.interleaved)
