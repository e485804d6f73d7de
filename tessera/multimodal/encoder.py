"""The vision side of a multimodal checkpoint, run through transformers' own modules: its
vision tower and projector (whatever the architecture calls them), built from the config
without the language model, loaded from the checkpoint, and called through the model's
`get_image_features`. tessera's own ops run the language model, where generation spends
its time; an image is encoded when a step of its prompt first reaches it."""
from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.weights.lazy import LazyTensor, materialize


# the attribute a transformers multimodal base model keeps its language model under
LANGUAGE_MODEL_ATTRS = ("language_model", "text_model")
# buffers older checkpoints saved that transformers now recomputes
RECOMPUTED_SUFFIXES = ("position_ids", "inv_freq")
# towers tessera does not serve (Gemma 4's audio): not built, their checkpoint tensors skipped
UNSERVED_TOWERS = ("audio_tower", "embed_audio")


class VisionWeightsError(ValueError):
    pass


def _base_model_class(config: PretrainedConfig) -> type[nn.Module]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(config.model_type)
    if name is None or not hasattr(transformers, name):
        raise ValueError(f"transformers has no base model for {config.model_type!r}")
    return getattr(transformers, name)


def canonical_name(name: str) -> str:
    """A vision weight's name with what checkpoint vintages differ in removed: the
    "model." transformers 4.52+ put in front, and the "vision_model." level some towers
    (CLIP, SigLIP) have as a whole model and not as a bare transformer."""
    name = name.removeprefix("model.")
    return re.sub(r"(?<=\.)vision_model\.", "", name)


class VisionEncoder(nn.Module):
    """`materialize=False`: only what the vision side is called, for a tensor-parallel rank
    other than the driver (which alone encodes): its tensors are recognised and skipped."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                 materialize: bool = True):
        super().__init__()
        with torch.device("meta"):
            hf = _base_model_class(config)._from_config(config)
        for attr in LANGUAGE_MODEL_ATTRS:
            if isinstance(getattr(hf, attr, None), nn.Module):
                delattr(hf, attr)
                break
        else:
            raise ValueError(f"{type(hf).__name__}: no language model under {LANGUAGE_MODEL_ATTRS}")
        self.unserved = {attr for attr in UNSERVED_TOWERS if isinstance(getattr(hf, attr, None), nn.Module)}
        for attr in self.unserved:
            setattr(hf, attr, None)  # (transformers' forward checks them for None)
        self.top_names = ({name for name, _ in hf.named_children()} | {n for n, _ in hf.named_parameters(recurse=False)}
                          | self.unserved)
        self.materialized = materialize
        if not materialize:
            self.hf = None
            return
        hf.to_empty(device=device)
        with torch.no_grad():
            hf.init_weights()  # computes the buffers (position ids, rotary tables) meta lost
        # the weights in the model dtype; computed float32 buffers (rotary tables) stay
        # float32, as transformers keeps them
        for module in hf.modules():
            for name, param in module._parameters.items():
                if param is not None and param.is_floating_point():
                    module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)
        self.hf = hf.eval().requires_grad_(False)
        self.dtype = dtype
        self._state = hf.state_dict(keep_vars=True)
        self._loaded: set[str] = set()
        self._by_canonical: dict[str, str] = {}
        for name in self._state:
            key = canonical_name(name)
            if key in self._by_canonical:
                raise ValueError(f"vision weights {self._by_canonical[key]} and {name} look alike")
            self._by_canonical[key] = name

    def weight_names(self) -> list[str]:
        """Its weights' names (a Hugging Face checkpoint's, as transformers names them now)."""
        return [n for n in self._state if not self._is_buffer(n)]

    def buffer_names(self) -> list[str]:
        """Its saved buffers' names (Gemma 4's clipped linears' bounds, its standardization)."""
        return [n for n in self._state if self._is_buffer(n)]

    def owns(self, checkpoint_name: str) -> bool:
        """Whether a checkpoint tensor is the vision side's (else the language model's)."""
        return canonical_name(checkpoint_name).split(".", 1)[0] in self.top_names

    def load_tensor(self, ckpt_name: str, tensor: torch.Tensor | LazyTensor) -> None:
        """Copy one of the vision side's checkpoint tensors in (read only here: a rank that
        is not the driver, or an unserved tower, leaves it unread)."""
        if not self.materialized or canonical_name(ckpt_name).split(".", 1)[0] in self.unserved:
            return
        name = self._by_canonical.get(canonical_name(ckpt_name))
        if name is None and ckpt_name.endswith(RECOMPUTED_SUFFIXES):
            return
        if name is None:
            raise VisionWeightsError(f"{ckpt_name}: no such weight in the vision tower or projector")
        target = self._state[name]
        if target.shape != tensor.shape:
            raise VisionWeightsError(f"{ckpt_name}: shape {tuple(tensor.shape)}, the model has "
                                     f"{tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(materialize(tensor))
        self._loaded.add(name)

    def check_loaded(self) -> int:
        """After the checkpoint: every weight of the vision side came; returns how many."""
        if not self.materialized:
            return 0
        missing = sorted(n for n in self._state if n not in self._loaded and not self._is_buffer(n))
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise VisionWeightsError(f"{len(missing)} vision weights were not in the checkpoint: {shown}")
        return len(self._loaded)

    def _is_buffer(self, name: str) -> bool:
        module_name, _, attr = name.rpartition(".")
        module = self.hf.get_submodule(module_name) if module_name else self.hf
        return attr in module._buffers

    @torch.inference_mode()
    def forward(self, encoder_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The features of the images `encoder_inputs` holds (the runner passes one image's),
        in placeholder order: [N, hidden], or [N, hidden * (1 + k)] with k DeepStack levels."""
        if not self.materialized:
            raise RuntimeError("this tensor-parallel rank holds no vision tower: the driver encodes")
        device = next(self.hf.parameters()).device
        inputs = {k: v.to(device, self.dtype if v.is_floating_point() else v.dtype)
                  for k, v in encoder_inputs.items()}
        out = self.hf.get_image_features(**inputs)
        features = _rows(getattr(out, "pooler_output", out))
        # Qwen3-VL's DeepStack: features of earlier vision layers, which the language model
        # adds after its first layers; they travel beside the main ones, [N, hidden * (1 + k)]
        levels = getattr(out, "deepstack_features", None) or []
        return torch.cat([features, *(_rows(level) for level in levels)], dim=-1)


def _rows(features: torch.Tensor | list | tuple) -> torch.Tensor:
    """Features given whole or per image, as one [N, width] tensor."""
    if isinstance(features, torch.Tensor):
        features = [features]
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
