from tessera.models.base import BaseRouter
from tessera.models.gemma2.router import Gemma2Router
from tessera.models.gemma3.modeling import Gemma3ForCausalLM
from tessera.models.gemma3.processing import Gemma3ImagePrompts
from tessera.models.vision_language import VisionLanguageRouter


class Gemma3Router(BaseRouter):
    # gemma3_text: the 1B checkpoint, and every size's GGUF (llama.cpp writes the text model)
    model_types = ("gemma3_text",)
    model_cls = Gemma3ForCausalLM
    supports_sliding_window = True  # tests/models/test_gemma3_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
    supports_gguf = True  # tests/weights/test_gguf_models.py
    # llama.cpp writes Gemma 3 (every size's text model) as Gemma 2, plus attn_q_norm / attn_k_norm
    gguf_names = Gemma2Router.gguf_names
    gguf_norm_offset = 1.0  # every norm, the head norms too, stored as 1 + w


class Gemma3VisionRouter(VisionLanguageRouter):
    """Gemma 3 4B-27B: a SigLIP tower at 896 pixels, a projector that average-pools its patches
    to 256 tokens an image, and Gemma 3's language model (gemma3_text). Unlike the other
    image models, an image's tokens attend to each other, not causally (transformers'
    token_type_ids mask): the scheduler keeps each image's run of tokens in one step and its
    rows see the whole run (key limits, tessera/ops/attention/metadata.py)."""
    model_types = ("gemma3",)
    image_prompts_cls = Gemma3ImagePrompts
    bidirectional_image_attention = True
    eos_from_top_level = True  # the end-of-turn id (the text config keeps its default, <eos>)
    supports_images = True  # tests/multimodal/test_gemma3.py
    supports_sliding_window = True  # tests/multimodal/test_gemma3.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/multimodal/test_vlm_lora.py
    # a GGUF language model with its --mmproj projector (tests/multimodal/test_gemma3_gguf.py)
    supports_gguf = True

    @property
    def longest_attention_span(self) -> int:
        return int(self.full_config.mm_tokens_per_image)  # each image, and each pan-and-scan crop
