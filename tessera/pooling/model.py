"""A text model as an embedding model or a classifier: its backbone, and no LM head or a
classification head instead.

Embedding checkpoints often hold the bare backbone (saved as Qwen3Model / MistralModel:
tensors named `layers.0...`, `norm.weight`, no `model.` prefix, no `lm_head`); a generative
checkpoint run with --runner pooling holds an LM head nothing reads. Both load: the LM head
is dropped before loading (an untied one would be vocabulary x hidden of memory for
nothing) and unprefixed names are taken as the backbone's.

A decoder classifier (Qwen3ForSequenceClassification, LlamaForSequenceClassification, ...)
has a `score` projection instead of the LM head. A causal LM asked to classify from tokens
(Qwen3-Reranker: --pooler-config '{"classifier_from_token": ["no", "yes"]}') keeps its LM
head and scores by those tokens' logits: two tokens make one label, the second's logit
minus the first's (the log-odds of "yes" against "no")."""
from __future__ import annotations

import torch
from torch import nn

from tessera.ops.linear import Linear
from tessera.ops.registry import OpTarget
from tessera.pooling.config import PoolerConfig


class TokenLogitsHead(nn.Module):
    """Label logits from the LM head's logits at the classifier tokens: its columns at those
    tokens, taken once after loading (`prepare_weights`) by running the head over the unit
    vectors, so they come whole on every tensor-parallel rank (each holds a slice of the
    vocabulary: the head's all-gather, at load time when all ranks run it) and in whatever
    layout or quantization the head keeps its weight. The driver then classifies alone."""

    UNIT_ROWS = 256  # unit vectors per pass: a vocabulary's logits for 256 rows at a time

    def __init__(self, lm_head: nn.Module, token_ids: tuple[int, ...]):
        super().__init__()
        self._lm_head = [lm_head]  # the model's own (a list: not registered a second time)
        self.token_ids = tuple(token_ids)
        self.columns: torch.Tensor | None = None  # [hidden, tokens], float32

    @torch.no_grad()
    def prepare_weights(self) -> None:
        head = self._lm_head[0]
        hidden, device = head.hidden_size, head.weight.device
        ids = torch.tensor(self.token_ids, device=device)
        parts = []
        for start in range(0, hidden, self.UNIT_ROWS):
            n = min(self.UNIT_ROWS, hidden - start)
            units = torch.zeros(n, hidden, dtype=head.input_dtype, device=device)
            units[torch.arange(n), torch.arange(start, start + n)] = 1
            parts.append(head(units).float().index_select(-1, ids))
        self.columns = torch.cat(parts)
        if not head.tied:  # nothing reads the rest of an untied head again: let it go
            head.weight = None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if self.columns is None:
            raise RuntimeError("the classifier tokens' columns are taken after loading (prepare_weights)")
        logits = rows.float() @ self.columns.to(rows.device)
        return logits[:, 1:] - logits[:, :1] if logits.shape[-1] == 2 else logits


def as_pooling_model(model: nn.Module, config: PoolerConfig | None = None, target: OpTarget | None = None
                     ) -> nn.Module:
    """`model` (a native causal LM: backbone `model`, head `lm_head`) changed in place for
    `config` (default: embeddings). A model with its own `classify` (an encoder's classifier)
    keeps it. A multimodal model's language model is changed (its hidden states are what
    it returns); the vision side stays."""
    language_model = getattr(model, "language_model", None)
    if isinstance(language_model, nn.Module) and not isinstance(getattr(model, "model", None), nn.Module):
        if config is not None and config.task != "embed":
            raise ValueError(f"{type(model).__name__} pools embeddings only")
        as_pooling_model(language_model, config, target)
        return model
    if not isinstance(getattr(model, "model", None), nn.Module) or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} has no `model` backbone and `lm_head` to pool from")
    own = dict(getattr(model, "checkpoint_prefixes", {}))
    heads: dict[str, str | None] = {"lm_head.": None}  # what the LM head's tensors become
    if config is not None and config.task == "classify" and not hasattr(model, "classify"):
        if config.classifier_token_ids:
            model.score = TokenLogitsHead(model.lm_head, config.classifier_token_ids)
            heads = {"lm_head.": "lm_head."}  # kept: it scores
        else:  # a *ForSequenceClassification checkpoint's projection
            model.score = Linear(model.config.hidden_size, len(config.labels), target)
            model.lm_head = None
            heads = {"lm_head.": None, "score.": "score."}
    else:
        model.lm_head = None
    # first match wins: the heads as above, the model's own renames, prefixed names as they
    # are, and anything else is the bare backbone's
    model.checkpoint_prefixes = {**heads, **own, "model.": "model.", "": "model."}
    return model


def classify_rows(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """A classifier's label logits for its pooled rows: the model's own head (encoders) or
    the one as_pooling_model gave it (decoders)."""
    head = getattr(model, "classify", None)
    return head(rows) if head is not None else model.score(rows)
