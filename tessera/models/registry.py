"""model_type -> Router, built by scanning the model folders of this package.

Each folder `tessera/models/<type>/router.py` defines BaseRouter subclasses declaring the
`model_types` they serve; a type claimed twice is an error at import.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
from functools import lru_cache
from pathlib import Path

from tessera.config import ModelConfig
from tessera.models.base import BaseRouter
from tessera.weights.gguf import gguf_metadata_folder
from tessera.weights.gguf_mmproj import gguf_mmproj_folder
from tessera.weights.source import ModelSource, resolve_model_source


class UnsupportedModelError(ValueError):
    pass


# Not a model folder: the router for types no folder serves, imported only when chosen
# (it imports transformers' modeling code, seconds of every start otherwise).
FALLBACK_PACKAGE = "transformers_fallback"


@lru_cache(maxsize=None)
def router_classes() -> dict[str, type[BaseRouter]]:
    import tessera.models as package

    found: dict[str, type[BaseRouter]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if not info.ispkg or info.name == FALLBACK_PACKAGE:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}.router")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseRouter) and obj.__module__ == module.__name__:
                for model_type in obj.model_types:
                    if model_type in found:
                        raise RuntimeError(f"model_type {model_type!r} is claimed by both "
                                           f"{found[model_type].__name__} and {obj.__name__}")
                    found[model_type] = obj
    return found


def supported_model_types() -> list[str]:
    return sorted(router_classes())


def get_router(model_config: ModelConfig, source: ModelSource | None = None) -> BaseRouter:
    source = source or resolve_model_source(model_config.model)
    metadata_dir = (gguf_metadata_folder(source.path, model_config.cache_dir)
                    if source.is_gguf else source.path)
    if model_config.mmproj:  # a GGUF's vision side: the folder a multimodal checkpoint would have
        if not source.is_gguf:
            raise ValueError("--mmproj goes with a GGUF model file (a Hugging Face folder holds its own vision tower)")
        metadata_dir = gguf_mmproj_folder(metadata_dir, Path(model_config.mmproj), model_config.cache_dir)
    model_type = json.loads((metadata_dir / "config.json").read_text()).get("model_type")
    cls = choose_router(model_type, model_config.model_impl, is_gguf=source.is_gguf)
    return cls(source, metadata_dir, model_config)


def choose_router(model_type: str | None, model_impl: str = "auto",
                  is_gguf: bool = False) -> type[BaseRouter]:
    """The router for `model_type` under --model-impl: native folders first under auto,
    transformers' own modeling code for types no folder serves (not for GGUF files, which
    only native folders load)."""
    native = router_classes().get(model_type)
    if native is not None and model_impl != "transformers":
        return native
    from tessera.models.transformers_fallback.router import TransformersRouter, transformers_has_causal_lm

    if model_impl == "transformers":
        return TransformersRouter
    if model_impl == "auto" and transformers_has_causal_lm(model_type) and not is_gguf:
        return TransformersRouter
    if is_gguf:
        fallback = " (GGUF files load only through native folders; the transformers fallback needs a safetensors folder)"
    elif transformers_has_causal_lm(model_type):  # only reachable under --model-impl native
        fallback = "; --model-impl auto or transformers runs it through transformers' modeling code"
    else:
        fallback = " and transformers has no causal LM for it"
    raise UnsupportedModelError(
        f"model_type {model_type!r} has no native folder{fallback}; native types: "
        f"{', '.join(supported_model_types())}")
