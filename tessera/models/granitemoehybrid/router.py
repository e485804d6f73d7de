import torch

from tessera.models.base import BaseRouter
from tessera.models.granitemoehybrid.modeling import GraniteMoeHybridForCausalLM
from tessera.weights.gguf_granitehybrid import mamba2_tensor


class GraniteMoeHybridRouter(BaseRouter):
    """IBM Granite 4.0 (granitemoehybrid: the -H hybrids' Mamba-2 and attention layers, and
    the dense attention-only sizes), experts with a shared MLP."""
    model_types = ("granitemoehybrid",)
    model_cls = GraniteMoeHybridForCausalLM
    is_moe = True  # tests/models/test_granite_hybrid.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (Mamba-2's projections, attention, shared MLP)
    supports_gguf = True  # tests/weights/test_gguf_granitehybrid.py (arch granitehybrid)
    gguf_permute_qk = True  # (the converter permutes them as Llama's, rotary or not)
    gguf_names = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_dt.bias": "mamba.dt_bias",
                  "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj",
                  "ffn_gate_inp": "block_sparse_moe.router.layer",
                  **{f"ffn_{proj}_exps": f"block_sparse_moe.experts.{{e}}.{w}" for proj, w in
                     (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
                  **{f"ffn_{proj}_shexp": f"mlp.shared_mlp.{proj}_proj" for proj in ("gate", "up", "down")}}

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return mamba2_tensor(name, tensor)
