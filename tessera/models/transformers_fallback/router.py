"""TransformersRouter: serves a model type with no native folder through transformers.

Not registered for any model_type: the registry picks it for `--model-impl transformers`, or
under `auto` when no native folder claims the type but transformers has a causal LM for it.
"""
from __future__ import annotations

import inspect
import logging
import sys
from typing import Callable, Iterable

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tessera.models.base import BaseRouter
from tessera.models.transformers_fallback.attention import ATTN_IMPLEMENTATION
from tessera.models.transformers_fallback.modeling import TransformersCausalLM
from tessera.ops.registry import OpTarget
from tessera.weights.dummy import load_dummy_weights

logger = logging.getLogger(__name__)


def transformers_has_causal_lm(model_type: str | None) -> bool:
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def uses_attention_interface(model_cls: type) -> bool:
    """Whether the model's modeling code looks its attention up in transformers' attention
    interface (where tessera's paged attention is registered). Older-style models (Falcon,
    Bloom, MPT, GPT-Neo, Mamba) compute attention themselves; their
    `_supports_attention_backend` flag says so too, but some models that do use the
    interface (StableLM) leave that flag False."""
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[model_cls.__module__])


class FallbackUnsupportedError(ValueError):
    """transformers cannot run this model under tessera's paged attention."""


class TransformersRouter(BaseRouter):
    model_types = ()   # chosen by the registry, never by model_type
    model_cls = TransformersCausalLM
    implementation = "transformers"

    def path_note(self) -> str:
        native = ("no native folder serves it" if self.model_config.model_impl == "auto"
                  else "--model-impl transformers")
        return (f"transformers fallback: {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(self.config.model_type, '?')} runs transformers' "
                f"modeling code with tessera's paged attention ({native})")

    def check_supported(self) -> None:
        cfg: PretrainedConfig = self.config
        if self.source.is_gguf:
            raise FallbackUnsupportedError(
                "GGUF files load only through native model folders; give the fallback a "
                "safetensors checkpoint directory")
        if self.model_config.quantization not in (None, "none"):
            raise FallbackUnsupportedError(
                f"--quantization {self.model_config.quantization} quantizes tessera's own linear "
                "layers; the transformers fallback runs transformers' modules, so it needs a "
                "native model folder (`tessera models` lists them)")
        if not transformers_has_causal_lm(cfg.model_type):
            raise FallbackUnsupportedError(
                f"transformers has no causal LM for model_type {cfg.model_type!r}")
        if getattr(cfg, "is_encoder_decoder", False):
            raise FallbackUnsupportedError(f"{cfg.model_type!r} is an encoder-decoder model; "
                                           "only decoder-only models are served")
        model_cls = AutoModelForCausalLM._model_mapping.get(type(cfg), None)
        if model_cls is not None and not uses_attention_interface(model_cls):
            raise FallbackUnsupportedError(
                f"{model_cls.__name__}'s attention does not go through transformers' attention "
                "interface, so tessera's paged attention cannot run it")
        recurrent = sorted({t for t in getattr(cfg, "layer_types", None) or ()
                            if isinstance(t, str) and ("attention" not in t or t.startswith("linear"))})
        if recurrent:
            raise FallbackUnsupportedError(
                f"{cfg.model_type!r} has {', '.join(recurrent)} layers, which keep a recurrent state between steps "
                "that the fallback does not carry; hybrid models need a native folder (qwen3_next, qwen3_5, "
                "granitemoehybrid, nemotron_h, lfm2, falcon_h1: `tessera models` lists them)")
        if not getattr(cfg, "num_attention_heads", None):
            raise FallbackUnsupportedError(f"{cfg.model_type!r} has no attention heads in its config "
                                           "(a state-space or hybrid model?); only attention models are served")

    def build_model(self, target: OpTarget) -> nn.Module:
        """transformers builds and loads the model itself (its loader knows every
        architecture's checkpoint layout), with our attention function in place."""
        self.check_supported()
        if self.model_config.load_format == "dummy":  # shapes only: no checkpoint read
            hf_model = AutoModelForCausalLM.from_config(self.config, dtype=target.dtype,
                                                        attn_implementation=ATTN_IMPLEMENTATION)
            load_dummy_weights(hf_model)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(self.source.path), config=self.config, dtype=target.dtype,
                attn_implementation=ATTN_IMPLEMENTATION)
        hf_model = hf_model.to(torch.device(target.device)).eval()
        logger.info("model_type %r runs on the transformers fallback (%s)",
                    self.config.model_type, type(hf_model).__name__)
        return TransformersCausalLM(hf_model, target)

    def load_weights(self, model: nn.Module,
                     progress: Callable[[Iterable], Iterable] = lambda it: it) -> int:
        """Already loaded (or dummy-filled) in build_model; the count of tensors it holds."""
        return len(model.hf_model.state_dict())
