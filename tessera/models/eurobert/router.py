from tessera.models.base import EncoderRouter
from tessera.models.eurobert.modeling import CLASSIFIER_POOLING, EuroBertForClassification, EuroBertForEmbedding


class EuroBertRouter(EncoderRouter):
    """EuroBERT encoders for embeddings and classification: they pool, never generate."""

    model_types = ("eurobert",)
    model_cls = EuroBertForEmbedding
    classifier_cls = EuroBertForClassification

    @property
    def default_pooling_type(self) -> str:  # type: ignore[override]
        """A classifier's pooled row (config.classifier_pooling); embeddings pool the mean."""
        if self.classifies:
            return CLASSIFIER_POOLING.get(getattr(self.config, "classifier_pooling", "late"), "MEAN")
        return "MEAN"
