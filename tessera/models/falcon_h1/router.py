import torch

from tessera.models.base import BaseRouter
from tessera.models.falcon_h1.modeling import FalconH1ForCausalLM
from tessera.weights.gguf_granitehybrid import mamba2_tensor


class FalconH1Router(BaseRouter):
    """TII's Falcon-H1 (falcon_h1): Mamba-2 and attention side by side in every layer."""
    model_types = ("falcon_h1",)
    model_cls = FalconH1ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (both mixers' projections, the MLP)
    supports_gguf = True  # tests/weights/test_gguf_falcon_h1.py (arch falcon-h1, its multipliers folded)
    gguf_permute_qk = True
    gguf_names = {"ffn_norm": "pre_ff_layernorm", "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                  "ffn_down": "feed_forward.down_proj", "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d",
                  "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_norm": "mamba.norm",
                  "ssm_out": "mamba.out_proj"}

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return mamba2_tensor(name, tensor)
