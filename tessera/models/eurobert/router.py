from tessera.models.base import BaseRouter
from tessera.models.eurobert.modeling import CLASSIFIER_POOLING, EuroBertForClassification, EuroBertForEmbedding
from tessera.ops.registry import OpTarget


class EuroBertRouter(BaseRouter):
    """EuroBERT encoders for embeddings and classification: they pool, never generate."""

    model_types = ("eurobert",)
    model_cls = EuroBertForEmbedding
    generates = False
    bidirectional = True

    def build_model(self, target: OpTarget):
        return (EuroBertForClassification if self.classifies else EuroBertForEmbedding)(self.config, target)

    @property
    def default_pooling_type(self) -> str:  # type: ignore[override]
        """A classifier's pooled row (config.classifier_pooling); embeddings pool the mean."""
        if self.classifies:
            return CLASSIFIER_POOLING.get(getattr(self.config, "classifier_pooling", "late"), "MEAN")
        return "MEAN"
