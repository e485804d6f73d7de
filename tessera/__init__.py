"""tessera: an LLM inference and serving engine."""
from tessera.engine.outputs import CompletionOutput, RequestOutput
from tessera.llm import LLM
from tessera.llm_beam_search import BeamSearchParams
from tessera.pooling.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from tessera.pooling.params import PoolingParams
from tessera.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EmbeddingRequestOutput", "PoolingParams",
           "PoolingRequestOutput", "RequestOutput", "SamplingParams", "__version__"]
