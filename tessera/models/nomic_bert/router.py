from transformers import PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.nomic_bert.gte import GteForClassification, GteForEmbedding
from tessera.models.nomic_bert.nomic import (NomicBertForClassification, NomicBertForEmbedding,
                                             take_remote_code_keys)
from tessera.ops.registry import OpTarget


class NomicBertRouter(BaseRouter):
    """NomicBERT encoders (nomic-embed-text v1 / v1.5): they pool, never generate. Their
    configs and tensors load in the remote code's names as well as in transformers'."""

    model_types = ("nomic_bert",)
    model_cls = NomicBertForEmbedding
    generates = False
    bidirectional = True

    @property
    def default_pooling_type(self) -> str:  # type: ignore[override]
        """A classifier's BERT head reads the first row; embeddings pool the mean, as
        nomic-embed-text does (its sentence-transformers files say so too)."""
        return "CLS" if self.classifies else "MEAN"

    def get_config(self) -> PretrainedConfig:
        return take_remote_code_keys(super().get_config())

    def build_model(self, target: OpTarget):
        return (NomicBertForClassification if self.classifies else NomicBertForEmbedding)(self.config, target)


class GteRouter(BaseRouter):
    """GTE encoders in transformers' `gte` type (gte-multilingual-base and its reranker):
    they pool, never generate."""

    model_types = ("gte",)
    model_cls = GteForEmbedding
    generates = False
    bidirectional = True
    default_pooling_type = "CLS"

    def build_model(self, target: OpTarget):
        return (GteForClassification if self.classifies else GteForEmbedding)(self.config, target)
