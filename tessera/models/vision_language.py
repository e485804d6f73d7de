"""VisionLanguageRouter: a multimodal checkpoint whose language model is a native type.

The router serves the text_config through that type's own model class (every op, kernel,
graph and quantization of it applies), and builds the vision side from transformers'
modules (tessera/multimodal/encoder.py). A model folder for a multimodal type subclasses
this, says where its config keeps the image token, and brings its own ImagePrompts where
transformers' processor does not do (per-image token counts, positions of its own)."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

import torch
from transformers import AutoConfig, PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.multimodal.encoder import VisionEncoder
from tessera.multimodal.model import VisionLanguageForCausalLM
from tessera.multimodal.processor import ImagePrompts
from tessera.ops.registry import OpTarget
from tessera.ops.weights import prepare_weights
from tessera.weights.dummy import load_dummy_weights
from tessera.weights.gguf_mmproj import iter_mmproj_weights
from tessera.weights.loader import load_weights, takes_int4_parts
from tessera.weights.prequantized import checkpoint_quantization

# checkpoint prefixes of a multimodal model's language model, across transformers' layouts
# (older: language_model.model.*, language_model.lm_head.*; 4.52+: model.language_model.*,
# lm_head.*; some: model.text_model.*, or a bare model.* beside a vision tower), first match
# wins -> the native language model's own names
LANGUAGE_MODEL_PREFIXES = {"language_model.lm_head.": "lm_head.", "lm_head.": "lm_head.",
                           "model.language_model.": "model.", "model.text_model.": "model.",
                           "language_model.model.": "model.", "language_model.": "model.",
                           "text_model.": "model.", "model.": "model."}


def language_model_name(name: str) -> str:
    """A language-model checkpoint name as the native model names it (model.* / lm_head.*)."""
    for prefix, replacement in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


class VisionLanguageRouter(BaseRouter):
    # config attributes naming the image placeholder token, first found wins
    image_token_attrs: ClassVar[tuple[str, ...]] = ("image_token_id", "image_token_index")
    # how prompts and images become token ids and encoder inputs
    image_prompts_cls: ClassVar[type[ImagePrompts]] = ImagePrompts
    # every image takes the same number of tokens (its processor resizes to one size)
    same_tokens_per_image: ClassVar[bool] = False
    # an image's tokens attend to each other, not causally (Gemma 3): the scheduler never
    # splits a run of them between steps, and its rows get key limits (attention/metadata.py)
    bidirectional_image_attention: ClassVar[bool] = False
    # the top level's EOS ids replace the text config's (Gemma: its end-of-turn ids are
    # there only); otherwise they fill in where the text config names none
    eos_from_top_level: ClassVar[bool] = False
    model_cls = VisionLanguageForCausalLM

    @cached_property
    def full_config(self) -> PretrainedConfig:
        return AutoConfig.from_pretrained(str(self.metadata_dir))

    def get_config(self) -> PretrainedConfig:
        full = self.full_config
        text = full.text_config
        if getattr(full, "eos_token_id", None) is not None and (
                self.eos_from_top_level or getattr(text, "eos_token_id", None) is None):
            text.eos_token_id = full.eos_token_id
        # transformers ties the LM head by the top level's flag (Qwen2.5-VL-3B ties, 7B does
        # not; the saved text config says False either way)
        text.tie_word_embeddings = bool(getattr(full, "tie_word_embeddings", False))
        return text

    @cached_property
    def checkpoint_quantization(self):
        """A pre-quantized multimodal checkpoint states its quantization at the top level."""
        return None if self.source.is_gguf else checkpoint_quantization(self.full_config)

    @cached_property
    def text_router(self) -> type[BaseRouter]:
        from tessera.models.registry import router_classes

        model_type = self.config.model_type
        router = router_classes().get(model_type)
        if router is None or issubclass(router, VisionLanguageRouter):
            raise ValueError(f"{self.full_config.model_type}: its language model ({model_type!r}) has no "
                             "native tessera folder")
        return router

    # a GGUF holds the language model as llama.cpp writes its text type: that router's names,
    # Q / K permutation and norm offset; a text type of the image model's own (Qwen's) names
    # the router whose conventions its file follows
    gguf_text_router: ClassVar[type[BaseRouter] | None] = None

    def _text_gguf(self, name: str) -> Any:
        from tessera.models.registry import router_classes

        router = self.gguf_text_router or router_classes().get(self.config.model_type)
        if router is None or issubclass(router, VisionLanguageRouter):
            raise ValueError(f"{self.full_config.model_type}: no router says how llama.cpp writes its language "
                             f"model ({self.config.model_type!r}) in a GGUF")
        return getattr(router, name)

    @property
    def gguf_permute_qk(self) -> bool:  # type: ignore[override]
        return self._text_gguf("gguf_permute_qk")

    @property
    def gguf_names(self) -> dict[str, str]:  # type: ignore[override]
        return self._text_gguf("gguf_names")

    @property
    def gguf_norm_offset(self) -> float:  # type: ignore[override]
        return self._text_gguf("gguf_norm_offset")

    @property
    def gguf_plain_norms(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._text_gguf("gguf_plain_norms")

    @cached_property
    def image_token_id(self) -> int:
        for attr in self.image_token_attrs:
            value = getattr(self.full_config, attr, None)
            if isinstance(value, int):
                return value
        raise ValueError(f"{self.full_config.model_type}: the config names no image token "
                         f"({', '.join(self.image_token_attrs)})")

    @cached_property
    def image_prompts(self) -> ImagePrompts:
        return self.image_prompts_cls(self.metadata_dir, self.image_token_id, self.same_tokens_per_image,
                                      self.bidirectional_image_attention, self.model_config.mm_processor_kwargs)

    @cached_property
    def chat_template(self) -> str | None:
        # multimodal folders often keep the template with the processor only
        return super().chat_template or self.image_prompts.chat_template

    def path_note(self) -> str:
        return (f"native language model ({self.language_model_cls().__name__}) with transformers' "
                "vision tower and projector")

    def language_model_cls(self) -> type[torch.nn.Module]:
        """The native class running text_config: its type's own, unless the multimodal type
        needs another (positions of its own)."""
        return self.text_router.model_cls

    def build_model(self, target: OpTarget) -> VisionLanguageForCausalLM:
        language_model = self.language_model_cls()(self.config, target)
        # the driver alone encodes (the step channel carries the features to the others)
        vision = VisionEncoder(self.full_config, target.dtype, torch.device(target.device),
                               materialize=target.tp_rank == 0)
        model = VisionLanguageForCausalLM(language_model, vision)
        # how LoRA adapters trained on transformers' model name this one's layers: the vision
        # side's are refused (model.py), the language model's are ours under language_model.
        model.checkpoint_prefixes = {
            **{f"{lead}{top}.": f"vision.{top}." for top in vision.top_names for lead in ("model.", "")},
            **{prefix: f"language_model.{to}" for prefix, to in LANGUAGE_MODEL_PREFIXES.items()}}
        return model

    def load_weights(self, model: VisionLanguageForCausalLM,
                     progress: Callable[[Iterable], Iterable] = lambda it: it) -> int:
        """The language model's tensors go to its own loader (prepared as they complete),
        the vision side's into transformers' modules."""
        if self.source.is_gguf and not self.model_config.mmproj:
            raise ValueError("a GGUF holds a multimodal model's language model only: pass its vision side "
                             "as --mmproj FILE (llama.cpp's projector GGUF)")
        if self.model_config.load_format == "dummy":
            count = load_dummy_weights(model.language_model)  # the vision side keeps its random init
            prepare_weights(model.language_model)
            return count
        vision = model.vision
        if self.source.is_gguf:  # the language model from the GGUF, the vision side from its mmproj file
            count = len(load_weights(model.language_model, progress(
                (language_model_name(n), t)
                for n, t in self.iter_weights(int4=takes_int4_parts(model.language_model))), prepare=True))
            if vision.materialized:
                for name, tensor in iter_mmproj_weights(Path(self.model_config.mmproj), vision.weight_names(),
                                                        vision.buffer_names()):
                    vision.load_tensor(name, tensor)
            count += vision.check_loaded()
            prepare_weights(model.language_model)
            return count

        def language_weights():
            for name, tensor in progress(self.iter_weights()):
                if vision.owns(name):
                    vision.load_tensor(name, tensor)  # (read there only if the vision side keeps it)
                else:
                    yield language_model_name(name), tensor

        count = len(load_weights(model.language_model, language_weights(), prepare=True))
        count += vision.check_loaded()
        prepare_weights(model.language_model)
        return count
