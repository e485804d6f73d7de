"""PEFT adapters for tests, made by PEFT itself on a tiny transformers model."""
from __future__ import annotations

import copy
from pathlib import Path

import torch


def save_peft_adapter(hf_model: torch.nn.Module, folder: Path, seed: int, std: float = 0.3,
                      save_kwargs: dict | None = None, **lora_config) -> torch.nn.Module:
    """Save a LoRA adapter of a copy of `hf_model` (r=8, alpha 16 unless told) with random B
    of standard deviation `std` (PEFT starts B at zero, which would change nothing);
    `save_kwargs` go to save_pretrained. Returns the PEFT model, for references."""
    from peft import LoraConfig, get_peft_model

    config = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, **lora_config}
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(**config)).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.normal_(std=std)
    peft_model.save_pretrained(folder, **(save_kwargs or {}))
    return peft_model
