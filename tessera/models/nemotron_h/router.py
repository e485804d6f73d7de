import torch

from tessera.models.base import BaseRouter
from tessera.models.nemotron_h.modeling import NemotronHForCausalLM
from tessera.weights.gguf_granitehybrid import mamba2_tensor


class NemotronHRouter(BaseRouter):
    """NVIDIA Nemotron-H, Nemotron Nano v2 and Nemotron 3 (nemotron_h): Mamba-2, attention, MLP
    and mixture-of-experts blocks."""
    model_types = ("nemotron_h",)
    model_cls = NemotronHForCausalLM
    is_moe = True  # tests/models/test_nemotron_h.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (Mamba-2's projections, attention, MLP)
    supports_gguf = True  # tests/weights/test_gguf_nemotron_h.py (archs nemotron_h, nemotron_h_moe)
    gguf_permute_qk = True  # (the converter permutes them as Llama's, though no rotary reads them)
    # llama.cpp's names -> the checkpoint's (every block's one mixer is `mixer`, its norm `norm`)
    gguf_names = {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
                  "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_norm": "mixer.norm",
                  "ssm_out": "mixer.out_proj", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
                  "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj",
                  "ffn_down": "mixer.down_proj", "ffn_gate_inp": "mixer.gate",
                  "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
                  "ffn_up_exps": "mixer.experts.{e}.up_proj", "ffn_down_exps": "mixer.experts.{e}.down_proj",
                  "ffn_up_shexp": "mixer.shared_experts.up_proj", "ffn_down_shexp": "mixer.shared_experts.down_proj",
                  "ffn_latent_down": "mixer.fc1_latent_proj", "ffn_latent_up": "mixer.fc2_latent_proj"}

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return mamba2_tensor(name, tensor)
