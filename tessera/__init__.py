"""tessera: an LLM inference and serving engine."""
from tessera.engine.outputs import CompletionOutput, RequestOutput
from tessera.llm import LLM
from tessera.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
