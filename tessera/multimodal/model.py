"""A multimodal causal LM: a native language model whose embedding rows at image
placeholders are replaced by the vision encoder's features."""
from __future__ import annotations

import torch
from torch import nn

from tessera.multimodal.encoder import VisionEncoder


class VisionLanguageForCausalLM(nn.Module):
    def __init__(self, language_model: nn.Module, vision: VisionEncoder):
        super().__init__()
        self.language_model = language_model
        self.vision = vision
        self.config = language_model.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                image_rows: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                image_positions: torch.Tensor | None = None) -> torch.Tensor:
        """`image_rows`: the rows of this step's tokens that are image placeholders,
        `image_embeds` their features (one row each), and for M-RoPE models
        `image_positions` their 3-D positions ([3, rows])."""
        if image_rows is None:
            return self.language_model(input_ids, positions)
        embeds = self.language_model.model.embed(input_ids)
        width = embeds.shape[-1]
        embeds = embeds.index_copy(0, image_rows, image_embeds[:, :width].to(embeds.dtype))
        extra = {}
        if image_embeds.shape[-1] > width:  # DeepStack levels (encoder.py; an M-RoPE model's): added
            # to the image rows after the language model's first layers
            extra = {"deepstack": image_embeds[:, width:].reshape(len(image_rows), -1, width)}
        if image_positions is None:
            return self.language_model(input_ids, positions, embeds)
        return self.language_model(input_ids, positions, embeds, mrope_rows=image_rows,
                                   mrope_positions=image_positions, **extra)

    @property
    def packed_modules_mapping(self) -> dict:
        return getattr(self.language_model, "packed_modules_mapping", {})

    def lora_refusal(self, module_name: str) -> str | None:
        """Why an adapter may not target this module (named as this model names it): LoRA
        runs on the language model's projections only."""
        if module_name.startswith("vision."):
            return "it adapts the vision tower or projector, which run as transformers' modules without LoRA"
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def encode_images(self, encoder_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.vision(encoder_inputs)
