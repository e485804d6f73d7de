"""What a request names to run with an adapter (vLLM's LoRARequest signature)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` identifies the adapter (the name clients use); `lora_path` is a PEFT
    folder (adapter_config.json + adapter_model.safetensors). `lora_int_id` is kept for
    vLLM compatibility: a positive integer, unique per adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
