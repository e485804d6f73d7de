"""ModernBERT encoders (answerdotai/ModernBERT and the embedders and rerankers built on it:
nomic's modernbert-embed, Alibaba's gte-modernbert, gte-reranker-modernbert), assembled from
shared ops. Module names follow transformers' ModernBertModel, so checkpoints load by name.

Unlike BERT: pre-norm layers (the first has no attention norm), rotary positions instead of
a position table, one packed Wqkv and a gated GELU MLP, no biases by default, a final norm.
Every `global_attn_every_n_layers`-th layer attends to the whole prompt; the others to the
`local_attention` // 2 tokens on each side of a token (Attention's sliding window behind it
and lookahead past it, within the prompt the engine runs whole in one step)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.gemma3.modeling import layer_rope_parameters
from tessera.ops.activation import Gelu
from tessera.ops.attention import Attention
from tessera.ops.embedding import VocabEmbedding
from tessera.ops.linear import Linear
from tessera.ops.norm import LayerNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary, RotaryEmbedding

Rope = tuple[torch.Tensor, torch.Tensor]


def norm(config: PretrainedConfig, target: OpTarget) -> LayerNorm:
    return LayerNorm(config.hidden_size, config.norm_eps, target, bias=config.norm_bias)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.tok_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, target)
        self.norm = norm(config, target)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, local: bool, target: OpTarget):
        super().__init__()
        heads = config.num_attention_heads
        if config.hidden_size % heads:
            raise ValueError(f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads {heads}")
        head_dim = config.hidden_size // heads
        self.Wqkv = Linear(config.hidden_size, 3 * config.hidden_size, target, bias=config.attention_bias)
        self.Wo = Linear(config.hidden_size, config.hidden_size, target, bias=config.attention_bias)
        self.rotary = ApplyRotary(head_dim, target)
        # local: |query - key| <= local_attention // 2, transformers' bidirectional window
        half = config.local_attention // 2
        window = dict(sliding_window=half + 1, lookahead=half) if local else {}
        self.attn = Attention(heads, head_dim, heads, scale=head_dim ** -0.5, target=target, **window)

    def forward(self, hidden: torch.Tensor, rope: Rope) -> torch.Tensor:
        q, k, v = self.Wqkv(hidden).chunk(3, dim=-1)
        q, k = self.rotary(q, k, rope)
        return self.Wo(self.attn(q, k, v.contiguous()))


class ModernBertMLP(nn.Module):
    """Wi packs the input and its gate: Wo(act(input) * gate)."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, target, bias=config.mlp_bias)
        self.act = Gelu(config.hidden_activation, target)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, target, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(hidden).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, target: OpTarget):
        super().__init__()
        self.local = config.layer_types[layer_idx] == "sliding_attention"
        # the embeddings' norm precedes the first layer, which has none of its own
        self.attn_norm = norm(config, target) if layer_idx else None
        self.attn = ModernBertAttention(config, self.local, target)
        self.mlp_norm = norm(config, target)
        self.mlp = ModernBertMLP(config, target)

    def forward(self, hidden: torch.Tensor, rope: Rope) -> torch.Tensor:
        hidden = hidden + self.attn(hidden if self.attn_norm is None else self.attn_norm(hidden), rope)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertModel(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        unknown = set(config.layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"modernbert layer types {sorted(unknown)} are not supported")
        self.embeddings = ModernBertEmbeddings(config, target)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i, target)
                                    for i in range(config.num_hidden_layers))
        self.final_norm = norm(config, target)
        head_dim = config.hidden_size // config.num_attention_heads
        params = layer_rope_parameters(config)  # global and local layers turn at their own theta
        self.global_rotary = RotaryEmbedding(head_dim, config.max_position_embeddings,
                                             params["full_attention"], target)
        self.local_rotary = RotaryEmbedding(head_dim, config.max_position_embeddings,
                                            params["sliding_attention"], target)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        ropes = (self.global_rotary(positions), self.local_rotary(positions))
        for layer in self.layers:
            hidden = layer(hidden, ropes[layer.local])
        return self.final_norm(hidden)


class ModernBertForEmbedding(nn.Module):
    """The encoder whose last hidden states (after the final norm) the engine pools."""

    ignored_weight_suffixes = ("position_ids",)
    # ModernBertModel's checkpoints name tensors bare, ModernBertFor* under model. beside
    # heads an embedding does not use (the MLM head and decoder, a classifier's)
    checkpoint_prefixes = {"head.": None, "decoder.": None, "classifier.": None}
    lm_head = None

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config, target)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, target, bias=config.classifier_bias)
        self.act = Gelu(config.classifier_activation, target)
        self.norm = norm(config, target)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(pooled)))


class ModernBertForClassification(ModernBertForEmbedding):
    """A cross-encoder or classifier (ModernBertForSequenceClassification): the engine pools
    each prompt's first row or mean (config.classifier_pooling) and `classify` turns it into
    label logits."""

    checkpoint_prefixes = {"head.": "head.", "classifier.": "classifier.", "decoder.": None}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.head = ModernBertPredictionHead(config, target)
        self.classifier = Linear(config.hidden_size, config.num_labels, target, bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled rows -> [N, labels] logits."""
        return self.classifier(self.head(pooled))
