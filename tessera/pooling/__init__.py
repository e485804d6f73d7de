"""Embedding (pooling) models: a prompt in, one vector out (vLLM's --runner pooling)."""
from tessera.pooling.config import PoolerConfig
from tessera.pooling.outputs import EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from tessera.pooling.params import PoolingParams

__all__ = ["EmbeddingRequestOutput", "PoolerConfig", "PoolingOutput", "PoolingParams", "PoolingRequestOutput"]
