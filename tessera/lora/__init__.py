"""LoRA adapters served on top of the base model, several in one batch (multi-LoRA)."""
from tessera.lora.request import LoRARequest

__all__ = ["LoRARequest"]
