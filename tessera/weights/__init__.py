from tessera.weights.loader import WeightLoadError, load_weights
from tessera.weights.source import ModelSource, resolve_model_source

__all__ = ["ModelSource", "WeightLoadError", "load_weights", "resolve_model_source"]
