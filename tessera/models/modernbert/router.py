from tessera.models.base import BaseRouter
from tessera.models.modernbert.modeling import ModernBertForClassification, ModernBertForEmbedding
from tessera.ops.registry import OpTarget


class ModernBertRouter(BaseRouter):
    """ModernBERT encoders for embeddings and reranking (modernbert-embed, gte-modernbert,
    gte-reranker-modernbert): they pool, never generate."""

    model_types = ("modernbert",)
    model_cls = ModernBertForEmbedding
    generates = False
    bidirectional = True
    supports_sliding_window = True

    def build_model(self, target: OpTarget):
        return (ModernBertForClassification if self.classifies else ModernBertForEmbedding)(self.config, target)

    @property
    def default_pooling_type(self) -> str:  # type: ignore[override]
        """What the checkpoint's classifier reads (config.classifier_pooling: cls or mean);
        embeddings without sentence-transformers' pooling file pool the same way."""
        return "MEAN" if getattr(self.config, "classifier_pooling", "cls") == "mean" else "CLS"
