import json

from transformers import PretrainedConfig

from tessera.models.base import EncoderRouter
from tessera.models.nomic_bert.gte import GteForClassification, GteForEmbedding
from tessera.models.nomic_bert.gte_new import MODEL_TYPE, gte_config_from_new
from tessera.models.nomic_bert.nomic import (NomicBertForClassification, NomicBertForEmbedding,
                                             take_remote_code_keys)


class NomicBertRouter(EncoderRouter):
    """NomicBERT encoders (nomic-embed-text v1 / v1.5): they pool, never generate. Their
    configs and tensors load in the remote code's names as well as in transformers'."""

    model_types = ("nomic_bert",)
    model_cls = NomicBertForEmbedding
    classifier_cls = NomicBertForClassification

    @property
    def default_pooling_type(self) -> str:  # type: ignore[override]
        """A classifier's BERT head reads the first row; embeddings pool the mean, as
        nomic-embed-text does (its sentence-transformers files say so too)."""
        return "CLS" if self.classifies else "MEAN"

    def get_config(self) -> PretrainedConfig:
        return take_remote_code_keys(super().get_config())


class GteRouter(EncoderRouter):
    """GTE encoders in transformers' `gte` type, or as Alibaba publishes them (the remote-code
    type `new`: gte-base / large-en-v1.5, gte-multilingual-base and its reranker): they
    pool, never generate."""

    model_types = ("gte", MODEL_TYPE)
    model_cls = GteForEmbedding
    classifier_cls = GteForClassification
    default_pooling_type = "CLS"

    def get_config(self) -> PretrainedConfig:
        raw = json.loads((self.metadata_dir / "config.json").read_text())
        return gte_config_from_new(raw) if raw.get("model_type") == MODEL_TYPE else super().get_config()
