from tessera.models.base import EncoderRouter
from tessera.models.modernbert.modeling import ModernBertForClassification, ModernBertForEmbedding


class ModernBertRouter(EncoderRouter):
    """ModernBERT encoders for embeddings and reranking (modernbert-embed, gte-modernbert,
    gte-reranker-modernbert): they pool, never generate."""

    model_types = ("modernbert",)
    model_cls = ModernBertForEmbedding
    classifier_cls = ModernBertForClassification
    supports_sliding_window = True

    @property
    def default_pooling_type(self) -> str:  # type: ignore[override]
        """What the checkpoint's classifier reads (config.classifier_pooling: cls or mean);
        embeddings without sentence-transformers' pooling file pool the same way."""
        return "MEAN" if getattr(self.config, "classifier_pooling", "cls") == "mean" else "CLS"
