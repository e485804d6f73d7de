"""The attention layer models use. It owns no weights: it writes this step's K/V into the
paged cache (bound by the runner) and runs the prefill and decode implementations chosen
from the registry over the rows of each kind."""
from __future__ import annotations

import torch

from tessera.ops.attention.metadata import current_metadata
from tessera.ops.module import OpModule
from tessera.ops.registry import OpTarget, get_op
from tessera.ops.rotary import ApplyRotary


class Attention(OpModule):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 target: OpTarget, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: bool = False, value_is_key: bool = False,
                 image_spans: bool = True, lookahead: int | None = None):
        """sliding_window: the query at position p sees keys in (p - window, p] (None: all).
        softcap: attention scores become softcap * tanh(scores / softcap) (gemma2).
        sinks: every forward passes a learned logit per query head that joins each softmax's
        denominator and adds no value (gpt-oss), so a head may attend to nothing.
        value_is_key: every forward's values are its keys (MLA's latent): the runner binds one
        cache tensor as both, half the memory.
        image_spans: whether a step's key limits (an image's tokens seeing each other) apply
        here; Gemma 4's full layers stay causal over images.
        lookahead: where a step's key limits let rows see past themselves (an encoder's
        prompt), the query at p sees keys up to p + lookahead at most; with sliding_window
        w = lookahead + 1, a window of lookahead tokens on each side (ModernBERT's local layers)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.scale = scale
        self.sliding_window, self.softcap, self.has_sinks = sliding_window, softcap, sinks
        self.value_is_key, self.image_spans = value_is_key, image_spans
        if lookahead is not None and lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 or None, got {lookahead}")
        self.lookahead = lookahead
        self.cache_tensors = 1 if value_is_key else 2  # what a cached token takes: K (and V)
        # The spec states which features are needed, so a kernel without them is rejected.
        # The cache keeps every token; freeing blocks that left the window is not done yet.
        features = dict(head_size=head_size, sliding_window=sliding_window is not None,
                        softcap=softcap is not None, sinks=sinks, kv_dtype=target.kv_cache_dtype)
        self._write = target.op("kv_write", head_size=head_size, kv_dtype=target.kv_cache_dtype)
        # rotary and the cache write in one kernel where a builder does both (CUDA); None:
        # the layer's rotary op, then kv_write
        self._rotary_write = None if value_is_key else target.optional_op(
            "rotary_kv_write", head_size=head_size, kv_dtype=target.kv_cache_dtype)
        self._prefill = target.op("paged_attention", phase="prefill", **features)
        self._decode = target.op("paged_attention", phase="decode", **features)
        # steps whose rows see past themselves (key limits: an image's tokens attending to
        # each other) take a builder that implements them, looked up when first needed
        self._limited_spec = target.spec("paged_attention", phase="prefill", key_limits=True, **features)
        self._limited = None
        # Bound by the runner once the cache is allocated: (k_cache, v_cache), of this dtype.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cache_dtype = target.kv_cache_dtype or target.dtype
        # Set by SharedKVAttention when later layers read this one's cache: this step's K/V
        # ([T, Hk, D]) stay here until the next step, for those layers' prefill rows.
        self.keeps_step_kv = False
        self.step_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None, rotary: ApplyRotary | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hk*D] -> [T, Hq*D]; sinks: [Hq] float32, exactly when the
        layer was built with sinks. `rotary` (with this step's `rope`): q and k are turned
        first, in one kernel with the cache write where a builder does both."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound; the model runner binds it before the first step")
        if (sinks is not None) != self.has_sinks:
            raise ValueError("attention sinks must be passed exactly when the layer was built with sinks=True")
        if self.value_is_key and v is not k:
            raise ValueError("a value_is_key layer caches its keys as its values: pass the keys as v")
        if (rotary is None) != (rope is None):
            raise ValueError("pass rotary and rope together")
        meta = current_metadata()
        fused = rotary is not None and self._rotary_write is not None and rotary.whole_heads
        if fused:  # the rotated keys and the values are in the cache already
            q, k = self._rotary_write(q, k, v, rope[0], rope[1], self.head_size, *self.kv_cache,
                                      meta.slot_mapping, meta.has_padding)
        elif rotary is not None:
            q, k = rotary(q, k, rope)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        if not fused:
            self._write(k, v, *self.kv_cache, meta.slot_mapping, meta.has_padding)
        if self.keeps_step_kv:
            self.step_kv = (k, v)
        return self.attend(q, k, v, sinks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q ([T, Hq*D]) over the cache, whose rows for this step's tokens are
        written already; k / v ([T, Hk, D]) are those rows, which prefill reads directly."""
        meta = current_metadata()
        if not self.image_spans:
            meta = meta.causal()
        elif self.lookahead is not None:
            meta = meta.within_lookahead(self.lookahead)
        k_cache, v_cache = self.kv_cache
        q = q.view(-1, self.num_heads, self.head_size)
        nd = meta.num_decode_tokens
        extra = (self.scale, self.sliding_window, self.softcap, sinks)
        prefill = self._prefill
        if meta.key_limits is not None:
            if self._limited is None:
                self._limited = get_op(self._limited_spec)
            prefill = self._limited
        if nd == q.shape[0]:
            out = self._decode(q, k_cache, v_cache, meta, *extra)
        elif nd == 0:
            out = prefill(q, k, v, k_cache, v_cache, meta, *extra)
        else:
            out = torch.cat((
                self._decode(q[:nd], k_cache, v_cache, meta, *extra),
                prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, *extra),
            ))
        return out.flatten(1)


class SharedKVAttention(OpModule):
    """Attention over another layer's cache (Gemma 4's num_kv_shared_layers: the last layers
    compute queries only and read the keys and values of the last earlier layer of their
    type). It owns no cache, so the runner sizes none for it; the producer keeps its step's
    K/V for the prefill rows."""

    def __init__(self, producer: Attention):
        super().__init__()
        producer.keeps_step_kv = True
        # a plain attribute, not a submodule: the producer is counted (and bound) once
        self.__dict__["producer"] = producer

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        producer = self.producer
        if producer.step_kv is None:
            raise RuntimeError("the layer whose cache this one shares has not run this step")
        return producer.attend(q, *producer.step_kv)
