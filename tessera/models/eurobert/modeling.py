"""EuroBERT (EuroBERT-210m / 610m / 2.1B): Llama's layers with attention both ways, for
embeddings and classification. The engine runs an encoder's prompt whole in one step with
every row seeing the whole prompt (models/bert/modeling.py), so Llama's own modules serve.

Its classifier (EuroBertForSequenceClassification) pools the first token ("bos") or the
mean and runs dense, GELU and the classifier; "late" pooling (every token classified, the
logits averaged) is not built."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaForCausalLM
from tessera.ops.activation import Gelu
from tessera.ops.linear import Linear
from tessera.ops.registry import OpTarget

CLASSIFIER_POOLING = {"bos": "CLS", "mean": "MEAN"}  # config.classifier_pooling -> the pooled row


class EuroBertForEmbedding(LlamaForCausalLM):
    """The backbone whose last hidden states (after the final norm) the engine pools."""


class EuroBertForClassification(LlamaForCausalLM):
    checkpoint_prefixes = {"dense.": "dense.", "classifier.": "classifier."}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        pooling = getattr(config, "classifier_pooling", "late")
        if pooling not in CLASSIFIER_POOLING:
            raise ValueError(f"EuroBERT's classifier_pooling {pooling!r} (each token classified, the logits "
                             f"averaged) is not supported; {', '.join(CLASSIFIER_POOLING)} are")
        super().__init__(config, target)
        self.dense = Linear(config.hidden_size, config.hidden_size, target, bias=True)
        self.activation = Gelu("gelu", target)
        self.classifier = Linear(config.hidden_size, config.num_labels, target, bias=True)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled rows -> [N, labels] logits."""
        return self.classifier(self.activation(self.dense(pooled)))
