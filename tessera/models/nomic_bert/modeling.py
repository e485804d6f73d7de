"""Post-norm rotary encoders: NomicBERT (nomic-embed-text v1 / v1.5) and GTE (Alibaba's
gte-multilingual-base and its reranker in transformers' `gte` type or as Alibaba publishes
them, with the English v1.5 models: gte_new.py), assembled from shared ops. Module names follow transformers' NomicBertModel and GteModel.

Like BERT, post-norm layers and word + token-type embeddings under a LayerNorm; unlike it,
rotary positions (no position table), a gated MLP (NomicBERT's SwiGLU, GTE's GeGLU with a
biased down projection) and, in NomicBERT, no biases. Every token attends to its whole
prompt, which the engine runs in one step (models/bert/modeling.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.bert.modeling import BertPooler
from tessera.ops.activation import GELU_APPROXIMATIONS, Gelu, GeluTanhAndMul, SiluAndMul
from tessera.ops.attention import Attention
from tessera.ops.embedding import VocabEmbedding
from tessera.ops.linear import Linear, PackedLinear, QKVLinear, RegroupedLinear
from tessera.ops.norm import LayerNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary, RotaryEmbedding, rope_parameters

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Family:
    """What differs between the families' layers."""

    attention_bias: bool = False  # q / k / v / o projections (GTE's have biases)
    down_bias: bool = False       # the MLP's down projection (GTE's has one)
    # the checkpoint holds the MLP's up and gate rows as one tensor, up first (GTE's up_gate_proj)
    up_gate_packed: bool = False


class RotaryEncoderEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden, target)
        types = getattr(config, "type_vocab_size", 0) or 0  # GTE's may be 0: no token types
        self.token_type_embeddings = VocabEmbedding(types, hidden, target) if types else None
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps, target)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            rows = rows + self.token_type_embeddings(types)
        return self.LayerNorm(rows)


class RotaryEncoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, target: OpTarget):
        super().__init__()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVLinear(config.hidden_size, head_dim, heads, heads, target, bias=bias)
        self.o_proj = Linear(heads * head_dim, config.hidden_size, target, bias=bias)
        self.rotary = ApplyRotary(head_dim, target)
        self.attn = Attention(heads, head_dim, heads, scale=head_dim ** -0.5, target=target)

    def forward(self, hidden: torch.Tensor, rope: Rope) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v))


class GatedMLP(nn.Module):
    """down(act(gate) * up), gate and up packed (shards 0 and 1), from two checkpoint tensors
    or (`family.up_gate_packed`) one, up rows first (shard "up_gate")."""

    def __init__(self, config: PretrainedConfig, family: Family, target: OpTarget):
        super().__init__()
        size = config.intermediate_size
        shards = {0: size, 1: size}
        self.gate_up_proj = (RegroupedLinear(config.hidden_size, shards, target, checkpoint_shards=("up_gate",),
                                             layouts={"up_gate": (1, ((1, size), (0, size)))})
                             if family.up_gate_packed else PackedLinear(config.hidden_size, shards, target))
        self.down_proj = Linear(size, config.hidden_size, target, bias=family.down_bias)
        act = config.hidden_act
        if act not in ("silu", *GELU_APPROXIMATIONS):
            raise ValueError(f"hidden_act {act!r} is not supported (silu or a GELU)")
        self.act_and_mul = (SiluAndMul(target) if act == "silu" else
                            GeluTanhAndMul(target) if GELU_APPROXIMATIONS[act] == "tanh" else None)
        self.gelu = Gelu(act, target) if self.act_and_mul is None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.gelu(gate) * up)


class RotaryEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, family: Family, target: OpTarget):
        super().__init__()
        self.self_attn = RotaryEncoderAttention(config, family.attention_bias, target)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, target)
        self.mlp = GatedMLP(config, family, target)
        self.post_mlp_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, target)

    def forward(self, hidden: torch.Tensor, rope: Rope) -> torch.Tensor:
        hidden = self.post_attention_layernorm(hidden + self.self_attn(hidden, rope))
        return self.post_mlp_layernorm(hidden + self.mlp(hidden))


class RotaryEncoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, family: Family, with_pooler: bool = False):
        super().__init__()
        self.embeddings = RotaryEncoderEmbeddings(config, target)
        self.layers = nn.ModuleList(RotaryEncoderLayer(config, family, target)
                                    for _ in range(config.num_hidden_layers))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config), target)
        self.pooler = BertPooler(config, target) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, token_type_ids)
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            hidden = layer(hidden, rope)
        return hidden


class RotaryEncoderForEmbedding(nn.Module):
    """The encoder whose last hidden states the engine pools. Subclasses say their `family`
    and the prefix of their checkpoints' backbone (`base_prefixes`: nomic_bert., gte.)."""

    family = Family()
    base_prefixes: tuple[str, ...] = ()
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    ignored_weight_suffixes = ("position_ids", "inv_freq")
    lm_head = None

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.config = config
        self.model = RotaryEncoderModel(config, target, self.family, with_pooler=hasattr(self, "classify"))
        # bare (the backbone saved alone) or under the family's prefix, beside heads an
        # embedding does not use (the pooler, MLM heads, a classifier)
        self.checkpoint_prefixes = {"pooler.": None, **{f"{p}pooler.": None for p in self.base_prefixes},
                                    **{p: "model." for p in self.base_prefixes},
                                    "cls.": None, "lm_head.": None, "classifier.": None}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, token_type_ids)


class RotaryEncoderForClassification(RotaryEncoderForEmbedding):
    """A cross-encoder or classifier (*ForSequenceClassification, BERT's head): the engine
    pools each prompt's first row; `classify` runs the pooler (dense, tanh) and classifier."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.classifier = Linear(config.hidden_size, config.num_labels, target, bias=True)
        self.checkpoint_prefixes = {**{p: "model." for p in self.base_prefixes}, "cls.": None, "lm_head.": None,
                                    "classifier.": "classifier."}

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token rows -> [N, labels] logits."""
        return self.classifier(self.model.pooler(first_rows))

