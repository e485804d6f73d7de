"""Gemma 4 (text), following transformers' modeling_gemma4 (Gemma4ForCausalLM, and the language
model of Gemma4ForConditionalGeneration):
- Gemma's sandwich layer: four RMSNorms (plain float32 weights, not 1 + w), a
  gelu_pytorch_tanh MLP, sqrt(hidden)-scaled embeddings, an optional final-logit soft-cap;
- attention as attention.py describes: per-type head sizes, q/k/v norms, unscaled scores,
  a sliding window on sliding layers, keys as values and KV sharing where configured;
- rotary per layer type: sliding layers' default table over their head size, full layers'
  proportional rope over the global head size;
- per-layer embeddings (the E2B / E4B models' PLE): a second, packed embedding table and a
  projection of the input embeddings give every layer a small vector per token, which the
  layer gates with its hidden state and adds back through a projection and a norm;
- use_double_wide_mlp: KV-shared layers' MLPs are twice as wide;
- enable_moe_block (26B A4B): experts beside the dense MLP (moe.py);
- every layer ends by multiplying the stream by its learned layer_scalar.

Gemma 4's releases are image(-audio)-text checkpoints (model_type "gemma4"): the router reads
their text_config and the vision and audio towers are skipped."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.gemma2.modeling import Gemma2ForCausalLM, Gemma2MLP, rounded
from tessera.models.gemma3.modeling import LAYER_TYPES, layer_rope_parameters
from tessera.models.gemma4.attention import Gemma4Attention, Gemma4SharedKVAttention, gemma4_norm, layer_shape
from tessera.models.gemma4.moe import Gemma4Experts, Gemma4Router
from tessera.models.llama.modeling import Rope
from tessera.ops.attention import attention_context, current_metadata
from tessera.ops.embedding import VocabEmbedding
from tessera.ops.linear import Linear
from tessera.ops.moe import HF_EXPERT_NAMES, expert_weight_target
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding
from tessera.ops.weights import make_param


def kv_producers(config: PretrainedConfig) -> dict[int, int]:
    """{KV-shared layer: the layer whose cache it reads}: the last layer of the same type
    before the shared ones (transformers' kv_sharing_modes)."""
    num_layers, shared = config.num_hidden_layers, getattr(config, "num_kv_shared_layers", 0) or 0
    first = num_layers - shared
    if shared and first <= 0:
        raise ValueError("gemma4: every layer shares another's KV cache (an assistant model that "
                         "reads its target's cache); it cannot run on its own")
    last_of_type = {kind: i for i, kind in enumerate(config.layer_types[:first])}
    producers = {}
    for i in range(first, num_layers):
        kind = config.layer_types[i]
        if kind not in last_of_type:
            raise ValueError(f"gemma4: layer {i} shares the KV of a {kind} layer, but none comes before it")
        producers[i] = last_of_type[kind]
    return producers


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, target: OpTarget,
                 producer: Gemma4Attention | None = None):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = (Gemma4Attention(config, layer_idx, target) if producer is None
                          else Gemma4SharedKVAttention(config, producer, target))
        wide = 2 if producer is not None and getattr(config, "use_double_wide_mlp", False) else 1
        self.mlp = Gemma2MLP(config, target, config.intermediate_size * wide)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, gemma4_norm(size, eps, target))
        self.moe = bool(getattr(config, "enable_moe_block", False))
        if self.moe:
            self.router = Gemma4Router(config, target)
            self.experts = Gemma4Experts(config, target)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                setattr(self, name, gemma4_norm(size, eps, target))
        self.per_layer = bool(getattr(config, "hidden_size_per_layer_input", 0))
        if self.per_layer:
            ple = config.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(size, ple, target)  # small: replicated
            self.per_layer_projection = Linear(ple, size, target)
            self.post_per_layer_input_norm = gemma4_norm(size, eps, target)
            self._gate = target.op("gelu_tanh_mul")
        self.layer_scalar = make_param((1,), target.dtype, target.device)
        self.scalar: float | None = None  # layer_scalar's value, read once loaded (prepare_weights)
        self._add = target.op("sum_and_scale")  # the sums and the final scale as kernels

    def prepare_weights(self) -> None:
        """The layer scalar as a number: the last residual add scales by it in the same call
        (times a bf16 scalar as torch's bf16 tensor product rounds)."""
        self.scalar = float(self.layer_scalar)

    def forward(self, rope: Rope, hidden: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        attended = self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(hidden)))
        normed, residual = self.pre_feedforward_layernorm(attended, hidden)  # the add fused in
        out = self.mlp(normed)
        if self.moe:
            weights, ids = self.router(residual)
            experts = self.experts(self.pre_feedforward_layernorm_2(residual), weights, ids)
            out = self._add(self.post_feedforward_layernorm_1(out), self.post_feedforward_layernorm_2(experts))
        scalar = self.scalar if self.scalar is not None else float(self.layer_scalar)  # (unprepared: read it)
        if not self.per_layer:
            return self._add(residual, self.post_feedforward_layernorm(out), scalar)
        hidden = self._add(residual, self.post_feedforward_layernorm(out))
        gated = self._gate(self.per_layer_input_gate(hidden), per_layer_input)
        return self._add(hidden, self.post_per_layer_input_norm(self.per_layer_projection(gated)), scalar)


class Gemma4Model(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        unknown = set(config.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"gemma4: unknown layer_types {sorted(unknown)}")
        size = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, size, target, scale=rounded(size ** 0.5, target))
        self.layer_types = list(config.layer_types)
        params = layer_rope_parameters(config)
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(layer_shape(config, self.layer_types.index(kind))[0],
                                  config.max_position_embeddings, params[kind], target)
            for kind in sorted(set(self.layer_types))})
        producers = kv_producers(config)
        layers: list[Gemma4DecoderLayer] = []
        for i in range(config.num_hidden_layers):
            producer = layers[producers[i]].self_attn if i in producers else None
            layers.append(Gemma4DecoderLayer(config, i, target, producer))
        self.layers = nn.ModuleList(layers)
        self.first_shared = min(producers, default=len(layers))
        self.norm = gemma4_norm(size, config.rms_norm_eps, target)
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", 0) or 0
        # image (video, audio) placeholder ids (the multimodal router sets them): embedded as
        # the padding token wherever they are not replaced by features, and the padding
        # token's per-layer embedding everywhere (transformers' Gemma 4 does both)
        self.register_buffer("placeholder_ids", torch.tensor(getattr(config, "placeholder_token_ids", None) or [],
                                                             dtype=torch.long, device=target.device), persistent=False)
        self.pad_token_id = config.pad_token_id or 0
        if self.per_layer_size:
            packed = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = VocabEmbedding(config.vocab_size_per_layer_input, packed, target,
                                                         scale=rounded(self.per_layer_size ** 0.5, target))
            self.per_layer_model_projection = Linear(size, packed, target)  # replicated
            self.per_layer_projection_norm = gemma4_norm(self.per_layer_size, config.rms_norm_eps, target)
            self.projection_scale = size ** -0.5
            self._add = target.op("sum_and_scale")

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` with placeholder ids made the padding token's."""
        if not self.placeholder_ids.numel():
            return input_ids
        return input_ids.masked_fill(torch.isin(input_ids, self.placeholder_ids), self.pad_token_id)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(self.text_ids(input_ids))

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, per-layer size]: the token's own per-layer embedding and a normed
        projection of its input embedding, averaged (times 1/sqrt(2))."""
        tokens, rows = embeds.shape[0], (embeds.shape[0], len(self.layers), self.per_layer_size)
        projected = self._add(self.per_layer_model_projection(embeds), None, self.projection_scale)
        projected = self.per_layer_projection_norm(projected.view(rows)).view(tokens, -1)
        return self._add(projected, self.embed_tokens_per_layer(input_ids), 2 ** -0.5).view(rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = self.text_ids(input_ids)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        ropes = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        hidden = self.run_layers(range(self.first_shared), hidden, ropes, per_layer)
        if self.first_shared < len(self.layers):
            hidden = self.shared_layers(hidden, ropes, per_layer)
        return self.norm(hidden)

    def run_layers(self, indices: range, hidden: torch.Tensor, ropes: dict[str, Rope],
                   per_layer: torch.Tensor | None) -> torch.Tensor:
        for i in indices:
            hidden = self.layers[i](ropes[self.layer_types[i]], hidden, None if per_layer is None else per_layer[:, i])
        return hidden

    def shared_layers(self, hidden: torch.Tensor, ropes: dict[str, Rope],
                      per_layer: torch.Tensor | None) -> torch.Tensor:
        """The KV-shared layers write no cache, so where the step says which rows' outputs
        are read (the LM head's) only those rows run them, each as a decode over its
        producers' caches (transformers' generate skips the other prompt rows too); no row
        at all for a partial prefill chunk. Steps whose rows see past themselves (images)
        run every row."""
        meta = current_metadata()
        indices = range(self.first_shared, len(self.layers))
        if meta.output_rows is None or meta.key_limits is not None or len(meta.output_rows_list) == hidden.shape[0]:
            return self.run_layers(indices, hidden, ropes, per_layer)
        if not meta.output_rows_list:
            return hidden  # nothing reads it
        rows = meta.output_rows
        picked = {kind: (cos.index_select(0, rows), sin.index_select(0, rows)) for kind, (cos, sin) in ropes.items()}
        with attention_context(meta.rows_as_decodes()):
            out = self.run_layers(indices, hidden.index_select(0, rows), picked,
                                  None if per_layer is None else per_layer.index_select(0, rows))
        return hidden.index_copy(0, rows, out)


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma4Model
    # the multimodal checkpoint's names (model.language_model.* as transformers saves it);
    # the vision and audio towers and their projections are not used
    checkpoint_prefixes = {"model.language_model.": "model.", "model.vision_tower.": None,
                           "model.audio_tower.": None, "model.embed_vision.": None, "model.embed_audio.": None}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError("gemma4 with use_bidirectional_attention='all' (an embedding model) is not "
                             "a causal LM; tessera serves causal generation only")
        super().__init__(config, target)
        # KV-shared layers have no K/V projections or norms; a checkpoint that still holds
        # them (transformers skips them on load) loads without them
        # (first: the first matching prefix wins)
        self.checkpoint_prefixes = {**{
            f"{root}layers.{i}.self_attn.{name}.": None
            for i in kv_producers(config) for root in ("model.", "model.language_model.")
            for name in ("k_proj", "v_proj", "k_norm", "v_norm")}, **type(self).checkpoint_prefixes}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """The experts' stacked tensors (gate_up_proj, down_proj) into ours."""
        return expert_weight_target(name, HF_EXPERT_NAMES)
