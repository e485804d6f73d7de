import torch

from tessera.models.base import BaseRouter
from tessera.models.qwen2_vl.processing import QwenVLImagePrompts
from tessera.models.qwen3_next.modeling import Qwen3NextForCausalLM
from tessera.models.qwen3_next.moe import Qwen3NextMoeForCausalLM
from tessera.models.qwen3_next.vision_language import Qwen3_5MoeVLForCausalLM, Qwen3_5VLForCausalLM
from tessera.models.vision_language import VisionLanguageRouter
from tessera.weights.gguf_qwen35 import qwen35_tensor


# llama.cpp's Qwen3.5 names (its Gated DeltaNet layers' tensors, the experts')
QWEN35_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    **{f"ffn_{proj}_shexp": f"mlp.shared_expert.{proj}_proj" for proj in ("gate", "up", "down")},
    **{f"ffn_{proj}_exps": f"mlp.experts.{{e}}.{proj}_proj" for proj in ("gate", "up", "down")},
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj"}  # (--fuse-gate-up-exps: gate rows, then up)
# llama.cpp stores every (1 + w) norm with the 1 added, but the gated one, a plain RMSNorm
QWEN35_PLAIN_NORMS = ("linear_attn.norm.weight",)


class Qwen3_5Router(BaseRouter):
    """Qwen3.5's dense models (qwen3_5_text): Gated DeltaNet and gated attention layers."""
    model_types = ("qwen3_5_text",)
    model_cls = Qwen3NextForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_qwen35.py (arch qwen35: weights/gguf_qwen35.py)
    gguf_names = QWEN35_GGUF_NAMES
    gguf_norm_offset, gguf_plain_norms = 1.0, QWEN35_PLAIN_NORMS
    supports_lora = True  # tests/lora/test_lora_models.py (linear and full attention, MLP)

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return qwen35_tensor(self.config, name, tensor)


class Qwen3NextRouter(BaseRouter):
    """Qwen3-Next-80B-A3B (qwen3_next) and Qwen3.5's mixtures of experts (qwen3_5_moe_text);
    also from llama.cpp's files (arch qwen3next, qwen35moe)."""
    model_types = ("qwen3_next", "qwen3_5_moe_text")
    model_cls = Qwen3NextMoeForCausalLM
    is_moe = True  # tests/models/test_qwen3_next.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_qwen35.py
    gguf_names = {**QWEN35_GGUF_NAMES, "ssm_ba": "linear_attn.in_proj_ba"}  # (Qwen3-Next's fused b / a)
    gguf_norm_offset, gguf_plain_norms = 1.0, QWEN35_PLAIN_NORMS
    supports_lora = True  # tests/lora/test_lora_models.py (attention of both kinds; experts refused)

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return qwen35_tensor(self.config, name, tensor)


class Qwen3_5VLRouter(VisionLanguageRouter):
    """Qwen3.5's image-text checkpoints (every Qwen3.5 release): Qwen3-VL's vision
    transformer without DeepStack (transformers' modules) and the native Qwen3.5 language
    model with interleaved M-RoPE positions. Images only (no video yet)."""
    model_types = ("qwen3_5",)
    supports_images = True  # tests/multimodal/test_qwen3_5_vl.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_qwen3_5_vl.py
    # a GGUF language model (arch qwen35 / qwen35moe) with its --mmproj projector
    # (tests/multimodal/test_qwen_vl_gguf.py)
    supports_gguf = True
    image_prompts_cls = QwenVLImagePrompts

    def language_model_cls(self):
        return Qwen3_5VLForCausalLM

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return qwen35_tensor(self.config, name, tensor)  # (self.config: the text config, as the text routers')


class Qwen3_5MoeVLRouter(Qwen3_5VLRouter):
    model_types = ("qwen3_5_moe",)
    supports_images = True  # tests/multimodal/test_qwen3_5_vl.py
    supports_gguf = True  # tests/multimodal/test_qwen_vl_gguf.py
    is_moe = True  # tests/multimodal/test_qwen3_5_vl.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_qwen3_5_vl.py (attention of both kinds; experts refused)

    def language_model_cls(self):
        return Qwen3_5MoeVLForCausalLM
