"""BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa), assembled from shared ops, for
embeddings. Module names follow transformers' BertModel, so checkpoints load by name.

Unlike the decoders, every token attends to every other token of its prompt. The engine
runs such a prompt in one step with key limits at its last position (AttentionMetadata),
so the paged prefill op computes full attention; the scheduler never splits the prompt and
no cached prefix is reused (a token's keys depend on the tokens after it)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.ops.activation import Gelu
from tessera.ops.attention import Attention
from tessera.ops.embedding import VocabEmbedding
from tessera.ops.linear import Linear, QKVLinear
from tessera.ops.norm import LayerNorm
from tessera.ops.registry import OpTarget


def position_offset(config: PretrainedConfig) -> int:
    """Where positions start in the table: 0 for BERT; RoBERTa's count from padding_idx + 1."""
    return config.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta") else 0


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden, target)
        self.position_embeddings = VocabEmbedding(config.max_position_embeddings, hidden, target)
        self.token_type_embeddings = VocabEmbedding(config.type_vocab_size, hidden, target)
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps, target)
        self.offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`token_type_ids`: a text pair's segments (a cross-encoder's query 0, document 1);
        None: every token is of type 0 (one text)."""
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        rows = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
                + self.token_type_embeddings(types))
        return self.LayerNorm(rows)


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv = QKVLinear(config.hidden_size, self.head_dim, heads, heads, target, bias=True)
        self.attn = Attention(heads, self.head_dim, heads, scale=self.head_dim ** -0.5, target=target)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv.split(self.qkv(hidden))
        return self.attn(q, k, v)


class BertResidualOutput(nn.Module):
    """dense, then LayerNorm over it plus the residual (post-norm: BertSelfOutput, BertOutput)."""

    def __init__(self, in_features: int, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, target, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, target)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.self = BertSelfAttention(config, target)
        self.output = BertResidualOutput(config.hidden_size, config, target)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, target, bias=True)
        self.act = Gelu(config.hidden_act, target)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.attention = BertAttention(config, target)
        self.intermediate = BertIntermediate(config, target)
        self.output = BertResidualOutput(config.intermediate_size, config, target)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, target) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """BERT's pooler (dense, tanh over the first token), read by its classification head."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, target, bias=True)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_rows))


class BertModel(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, with_pooler: bool = False):
        super().__init__()
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported (absolute only)")
        self.embeddings = BertEmbeddings(config, target)
        self.encoder = BertEncoder(config, target)
        self.pooler = BertPooler(config, target) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden)
        return hidden


class BertForEmbedding(nn.Module):
    """The encoder whose last hidden states the engine pools; it has no LM head."""

    packed_modules_mapping = {"query": ("qkv", "q"), "key": ("qkv", "k"), "value": ("qkv", "v")}
    ignored_weight_suffixes = ("position_ids",)
    # checkpoints of BertModel name tensors bare; BertFor* / RobertaFor* under bert. / roberta.,
    # beside heads an embedding does not use (BERT's pooler, MLM heads, classifiers)
    checkpoint_prefixes = {"bert.pooler.": None, "roberta.pooler.": None, "pooler.": None,
                           "bert.": "model.", "roberta.": "model.", "cls.": None, "classifier.": None}
    lm_head = None

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.config = config
        self.model = BertModel(config, target)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, token_type_ids)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, None] | None:
        """Older checkpoints name LayerNorm parameters gamma / beta (transformers renames them)."""
        if name.endswith(".gamma"):
            return name[:-len("gamma")] + "weight", None
        if name.endswith(".beta"):
            return name[:-len("beta")] + "bias", None
        return None


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, target, bias=True)
        self.out_proj = Linear(config.hidden_size, config.num_labels, target, bias=True)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_rows)))


class BertForClassification(BertForEmbedding):
    """A cross-encoder or classifier (BertForSequenceClassification and the RoBERTa kinds):
    the engine pools each prompt's first row and `classify` turns it into label logits."""

    checkpoint_prefixes = {"bert.": "model.", "roberta.": "model.", "cls.": None, "classifier.": "classifier."}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        nn.Module.__init__(self)
        self.config = config
        roberta = config.model_type in ("roberta", "xlm-roberta")
        self.model = BertModel(config, target, with_pooler=not roberta)
        self.classifier = (RobertaClassificationHead(config, target) if roberta
                           else Linear(config.hidden_size, config.num_labels, target, bias=True))

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token rows -> [N, labels] logits."""
        if self.model.pooler is None:
            return self.classifier(first_rows)
        return self.classifier(self.model.pooler(first_rows))
