from tessera.ops.attention import torch_paged  # noqa: F401  (registers the reference builders)
from tessera.ops.attention.layer import Attention
from tessera.ops.attention.metadata import AttentionMetadata, attention_context, current_metadata

__all__ = ["Attention", "AttentionMetadata", "attention_context", "current_metadata"]
