from functools import cached_property

from transformers import PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.gemma2.router import Gemma2Router
from tessera.models.gemma4.modeling import Gemma4ForCausalLM
from tessera.models.gemma4.processing import Gemma4ImagePrompts
from tessera.models.vision_language import VisionLanguageRouter

# the top-level config's placeholder token ids (their per-layer embeddings are the padding's)
PLACEHOLDER_ATTRS = ("image_token_id", "video_token_id", "audio_token_id")


class Gemma4TextRouter(BaseRouter):
    """gemma4_text: a text-only checkpoint, and every size's GGUF (llama.cpp writes the
    language model; weights/gguf_gemma4.py reads its config)."""
    model_types = ("gemma4_text",)
    model_cls = Gemma4ForCausalLM
    supports_gguf = True  # tests/weights/test_gguf_gemma4.py
    # llama.cpp's names beyond Gemma 2's four norms (plain weights: no norm offset)
    gguf_names = {**Gemma2Router.gguf_names, "post_ffw_norm_1": "post_feedforward_layernorm_1",
                  "post_ffw_norm_2": "post_feedforward_layernorm_2", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                  "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                  "post_norm": "post_per_layer_input_norm", "ffn_gate_inp": "router.proj",
                  "ffn_gate_up_exps": "experts.gate_up_proj", "ffn_down_exps": "experts.down_proj",
                  "ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
                  "layer_output_scale.weight": "layer_scalar"}
    is_moe = True  # tests/models/test_gemma4.py (the 26B A4B: experts beside the dense MLP)
    supports_sliding_window = True  # tests/models/test_gemma4.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py


class Gemma4VisionRouter(VisionLanguageRouter):
    """Gemma 4's released checkpoints (E2B, E4B, 26B A4B, 31B): images through transformers'
    Gemma 4 vision tower and embedder, text through the native model. Where the text config
    says use_bidirectional_attention "vision", an image's tokens see each other on the
    sliding layers (the full layers stay causal, as in transformers). Audio and video are not
    served (the audio tower is not built: multimodal/encoder.py's UNSERVED_TOWERS)."""
    model_types = ("gemma4",)
    image_prompts_cls = Gemma4ImagePrompts
    eos_from_top_level = True  # the end-of-turn ids
    is_moe = True  # tests/models/test_gemma4.py
    supports_images = True  # tests/multimodal/test_gemma4.py
    supports_sliding_window = True  # tests/multimodal/test_gemma4.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
    # a GGUF language model with its --mmproj projector (tests/multimodal/test_gemma4_gguf.py)
    supports_gguf = True

    @cached_property
    def bidirectional_image_attention(self) -> bool:  # type: ignore[override]
        return getattr(self.config, "use_bidirectional_attention", None) == "vision"

    @property
    def longest_attention_span(self) -> int:
        return self.image_prompts.longest_image_tokens() if self.bidirectional_image_attention else 0

    def get_config(self) -> PretrainedConfig:
        text = super().get_config()
        text.placeholder_token_ids = [v for v in (getattr(self.full_config, a, None) for a in PLACEHOLDER_ATTRS)
                                      if v is not None]
        return text
