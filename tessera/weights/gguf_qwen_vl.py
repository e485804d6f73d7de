"""The language models of Qwen's image-text checkpoints from a GGUF, read as llama.cpp writes
them: arch "qwen2vl" (Qwen2-VL, Qwen2.5-VL: Qwen2's tensors), "qwen3vl" (Qwen3-VL: Qwen3's)
and "qwen3vlmoe" (Qwen3-VL-MoE: Qwen3-MoE's), Q and K unpermuted, the M-RoPE sections as
`{arch}.rope.dimension_sections` (four numbers padded with 0). transformers' GGUF
conversion knows none of the three.

Alone a file is served as the text model it is (Qwen2, Qwen3, Qwen3-MoE): M-RoPE gives a
text token the same position on all three axes, which is plain rotary, interleaved or not.
The sections stay in the config (`mrope_section`) for a projector file (--mmproj:
gguf_mmproj_qwen.py) to rebuild the image-text model from, with Qwen3-VL's DeepStack depth
(`n_deepstack_layers`)."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config
from tessera.weights.gguf_rope import field_value

ARCHES = ("qwen2vl", "qwen3vl", "qwen3vlmoe")
MROPE_SECTION = "mrope_section"  # the config fields the file's image-text settings are kept in
DEEPSTACK_LAYERS = "n_deepstack_layers"


def mrope_sections(fields: dict, arch: str) -> list[int]:
    """The file's M-RoPE sections (`{arch}.rope.dimension_sections`, padded with 0 to four),
    the padding taken off; [] where the file has none."""
    sections = [int(s) for s in field_value(fields, f"{arch}.rope.dimension_sections") or []]
    while sections and sections[-1] == 0:
        sections.pop()
    return sections


def _experts(arch: str, fields: dict, tensors: list, layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert keys; layers without a router are dense (mlp_only_layers)."""
    def key(name: str) -> Any:
        value = field_value(fields, f"{arch}.{name}")
        if value is None:
            raise ValueError(f"{arch} GGUF: the file lacks {arch}.{name}")
        return int(value)

    routed = {int(t.name.split(".")[1]) for t in tensors if t.name.endswith("ffn_gate_inp.weight")}
    return dict(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[i for i in range(layers) if i not in routed])


def qwen_vl_text_config(fields: dict, tensors: list) -> Any:
    """The text model's config for the file (Qwen2Config, Qwen3Config or Qwen3MoeConfig),
    with its M-RoPE sections (and Qwen3-VL's DeepStack depth)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    arch = field_value(fields, "general.architecture")
    sections = mrope_sections(fields, arch)
    if not sections:
        raise ValueError(f"{arch} GGUF: the file lacks {arch}.rope.dimension_sections")
    extra: dict[str, Any] = {MROPE_SECTION: sections}
    if arch == "qwen2vl":
        return plain_decoder_config(Qwen2Config, arch, fields, tensors, architectures=["Qwen2ForCausalLM"], **extra)
    extra[DEEPSTACK_LAYERS] = int(field_value(fields, f"{arch}.{DEEPSTACK_LAYERS}") or 0)
    if arch == "qwen3vl":
        return plain_decoder_config(Qwen3Config, arch, fields, tensors, architectures=["Qwen3ForCausalLM"], **extra)
    layers = int(field_value(fields, f"{arch}.block_count") or 0)
    return plain_decoder_config(Qwen3MoeConfig, arch, fields, tensors, architectures=["Qwen3MoeForCausalLM"],
                                **extra, **_experts(arch, fields, tensors, layers))
