import logging

from transformers import AutoConfig, PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.qwen3_next.modeling import Qwen3NextForCausalLM
from tessera.models.qwen3_next.moe import Qwen3NextMoeForCausalLM

logger = logging.getLogger(__name__)


class Qwen3_5Router(BaseRouter):
    """Qwen3.5's dense models (qwen3_5_text): Gated DeltaNet and gated attention layers."""
    model_types = ("qwen3_5_text",)
    model_cls = Qwen3NextForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py


class Qwen3NextRouter(BaseRouter):
    """Qwen3-Next-80B-A3B (qwen3_next) and Qwen3.5's mixtures of experts (qwen3_5_moe_text)."""
    model_types = ("qwen3_next", "qwen3_5_moe_text")
    model_cls = Qwen3NextMoeForCausalLM
    is_moe = True  # tests/models/test_qwen3_next.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py


class _TextOnly:
    """Qwen3.5's image-text checkpoints, served as their language model: images are not
    supported yet (the vision tower's weights are not loaded)."""

    def get_config(self) -> PretrainedConfig:
        full = AutoConfig.from_pretrained(str(self.metadata_dir))
        logger.warning("%s: serving the language model only; requests with images are refused", full.model_type)
        text = full.text_config
        if getattr(full, "eos_token_id", None) is not None:
            text.eos_token_id = full.eos_token_id
        return text


class Qwen3_5TextOnlyRouter(_TextOnly, Qwen3_5Router):
    model_types = ("qwen3_5",)
    supports_tensor_parallel = True  # as its language model's


class Qwen3_5MoeTextOnlyRouter(_TextOnly, Qwen3NextRouter):
    model_types = ("qwen3_5_moe",)
    is_moe = True
    supports_tensor_parallel = True  # as its language model's
