"""Llama, assembled from shared ops. Reads like Hugging Face's modeling_llama, minus the
cache plumbing: attention metadata arrives through the runner's attention context."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.ops.activation import SiluAndMul
from tessera.ops.attention import Attention
from tessera.ops.embedding import LMHead, VocabEmbedding
from tessera.ops.linear import PackedLinear, QKVLinear, RowParallelLinear
from tessera.ops.norm import RMSNorm
from tessera.ops.pending_norm import PendingNorm, can_fuse_input_norms
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary, RotaryEmbedding, rope_parameters

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config: PretrainedConfig) -> int:
    """How many of each head's dimensions rotary turns: all, or partial_rotary_factor of
    them (Phi-4-mini: 0.75), from the config or its rope parameters."""
    factor = rope_parameters(config).get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    return int(head_dim_of(config) * (factor or 1.0))


class LlamaMLP(nn.Module):
    input_to_one_linear = True  # forward's input goes to gate_up_proj only (ops/pending_norm.py)

    def __init__(self, config: PretrainedConfig, target: OpTarget, intermediate_size: int | None = None):
        """`intermediate_size`: other than the config's (DeepSeek's shared experts)."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act 'silu' only, got {config.hidden_act!r}")
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {0: size, 1: size}, target, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, target, bias=bias)
        self.act_fn = SiluAndMul(target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.gated(self.act_fn, self.gate_up_proj(x))  # one op where a kernel does both


class LlamaAttention(nn.Module):
    uses_rope = True  # False: no rotary (SmolLM3's NoPE layers, Granite 4.0-H's, Nemotron-H's attention)
    input_to_one_linear = True  # forward's hidden goes to qkv_proj only (ops/pending_norm.py)

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads,
                                  target, bias=qkv_bias)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, target,
                                        bias=o_bias, in_span=self.qkv_proj.o_proj_span)
        self.rotary = ApplyRotary(self.head_dim, target, rotary_dim_of(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, target=target,
                              **self.attention_options(config))

    def attention_options(self, config: PretrainedConfig) -> dict:
        """Attention's scale / sliding_window / softcap; Llama: 1/sqrt(head_dim), full, none."""
        return {"scale": self.head_dim ** -0.5}

    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """(Q/K/V bias, o_proj bias); Llama: both follow attention_bias."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.uses_rope:  # rotary in the attention op: with the cache write where one kernel does both
            return self.o_proj(self.attn(q, k, v, rotary=self.rotary, rope=rope))
        return self.o_proj(self.attn(q, k, v))


def add_and_norm(norm: nn.Module, hidden: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm: (norm(hidden + residual), hidden + residual), the add fused
    into the norm; the first layer's input has no residual yet."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP
    norms_into_linears = False  # set by __init__ (a subclass building its own modules keeps False)

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.self_attn = self.attention_cls(config, target)
        self.mlp = self.mlp_cls(config, target)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        # the two norms computed by the linears reading them, where one op does both (CUDA)
        self.norms_into_linears = can_fuse_input_norms(self.self_attn, self.mlp)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.norms_into_linears:
            pending = PendingNorm(self.input_layernorm, hidden, residual)
            hidden = self.self_attn(rope, pending)
            pending = PendingNorm(self.post_attention_layernorm, hidden, pending.next_residual())
            return self.mlp(pending), pending.next_residual()
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, target,
                                           scale=self.embedding_scale(config))
        self.rotary_emb = self.make_rotary(config, target)
        self.layers = nn.ModuleList(self.make_layer(config, i, target) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)

    def embedding_scale(self, config: PretrainedConfig) -> float | None:
        """What the embedding op multiplies every row by (None: nothing)."""
        return None

    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> nn.Module | None:
        """The rotary table the layers share (multimodal positions, tables per layer type:
        types that differ override this)."""
        return RotaryEmbedding(rotary_dim_of(config), config.max_position_embeddings, rope_parameters(config), target)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        """Decoder layer `layer_idx`; types whose layers differ by index override this."""
        return self.layer_cls(config, target)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows the first layer takes for these tokens (a multimodal model replaces
        some of them with image features)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, **rope_inputs: torch.Tensor) -> torch.Tensor:
        """`rope_inputs`: what a rotary embedding takes beyond positions (M-RoPE's 3-D
        positions of image tokens)."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.step_rope(positions, **rope_inputs)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def step_rope(self, positions: torch.Tensor, **rope_inputs: torch.Tensor) -> Rope:
        """This step's rotary inputs, shared by every layer (a model may add to them)."""
        return self.rotary_emb(positions, **rope_inputs)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our packed parameter's fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that carry nothing we load (recomputed buffers)
    ignored_weight_suffixes = ("rotary_emb.inv_freq",)
    model_cls = LlamaModel

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, target)
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, target, tied_to=tied)
        if tied is not None:
            self.ignored_weight_suffixes = (*self.ignored_weight_suffixes, "lm_head.weight")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, **rope_inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds, **rope_inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
