from functools import cached_property

from tessera.models.base import EncoderRouter
from tessera.models.bert.modeling import BertForClassification, BertForEmbedding, position_offset


class BertRouter(EncoderRouter):
    """Encoders for embeddings (sentence-transformers' BERT, MiniLM, BGE, E5, GTE, and
    XLM-RoBERTa's multilingual ones): they pool, never generate."""

    model_types = ("bert", "roberta", "xlm-roberta")
    model_cls = BertForEmbedding
    classifier_cls = BertForClassification
    default_pooling_type = "CLS"

    @cached_property
    def max_model_len(self) -> int:
        """The position table's rows past RoBERTa's offset."""
        limit = self.config.max_position_embeddings - position_offset(self.config)
        wanted = self.model_config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the encoder's {limit} positions")
        return wanted or limit
