"""model_type -> Router, built by scanning the model folders of this package.

Each folder `tessera/models/<type>/router.py` defines BaseRouter subclasses declaring the
`model_types` they serve; a type claimed twice is an error at import.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
from functools import lru_cache

from tessera.config import ModelConfig
from tessera.models.base import BaseRouter
from tessera.weights.gguf import gguf_metadata_folder
from tessera.weights.source import ModelSource, resolve_model_source


class UnsupportedModelError(ValueError):
    pass


@lru_cache(maxsize=None)
def router_classes() -> dict[str, type[BaseRouter]]:
    import tessera.models as package

    found: dict[str, type[BaseRouter]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if not info.ispkg:
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
    model_type = json.loads((metadata_dir / "config.json").read_text()).get("model_type")
    cls = router_classes().get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported types: {', '.join(supported_model_types())}")
    return cls(source, metadata_dir, model_config)
