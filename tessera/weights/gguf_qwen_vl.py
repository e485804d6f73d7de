"""Qwen2-VL and Qwen2.5-VL's language model from a GGUF, read as llama.cpp writes it (arch
"qwen2vl": Qwen2's tensors, Q and K unpermuted, and the M-RoPE sections as
`qwen2vl.rope.dimension_sections`, four numbers padded with 0). transformers' GGUF
conversion does not know the architecture.

Alone the file is served as the Qwen2 it is for text: M-RoPE gives a text token the same
position on all three axes, which is plain rotary. The sections stay in the config
(`mrope_section`) for a projector file (--mmproj: gguf_mmproj_qwen.py) to rebuild the
image-text model from."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config
from tessera.weights.gguf_rope import field_value

ARCH = "qwen2vl"
MROPE_SECTION = "mrope_section"  # the config field the sections are kept in


def qwen2vl_config(fields: dict, tensors: list) -> Any:
    """A Qwen2Config for the file, with its M-RoPE sections."""
    from transformers import Qwen2Config

    sections = [int(s) for s in field_value(fields, f"{ARCH}.rope.dimension_sections") or []]
    while sections and sections[-1] == 0:
        sections.pop()
    if not sections:
        raise ValueError(f"{ARCH} GGUF: the file lacks {ARCH}.rope.dimension_sections")
    return plain_decoder_config(Qwen2Config, ARCH, fields, tensors, architectures=["Qwen2ForCausalLM"],
                                **{MROPE_SECTION: sections})
