from typing import Iterator

import torch

from tessera.models.base import BaseRouter
from tessera.models.phi3.modeling import Phi3ForCausalLM


class Phi3Router(BaseRouter):
    model_types = ("phi3",)
    model_cls = Phi3ForCausalLM
    supports_sliding_window = True  # tests/models/test_phi3_parity.py "sliding-window"
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.source.is_gguf:  # llama.cpp's fused phi3 tensor names are not mapped yet
            raise ValueError("phi3: GGUF checkpoints are not supported yet; use a Hugging Face folder")
        return super().iter_weights()
