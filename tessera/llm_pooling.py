"""LLM's methods for models that pool instead of generating (vLLM's names): embed, score and
classify. Mixed into tessera.llm.LLM, whose engine and request loop they use."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence as Seq

from tessera.pooling.outputs import ClassificationOutput, ClassificationRequestOutput, PoolingRequestOutput
from tessera.pooling.params import PoolingParams
from tessera.pooling.scoring import (ScoringOutput, ScoringRequestOutput, cosine_scores,
                                     cross_encoder_prompts, cross_encoder_score, label_probabilities, pair_indices)


class PoolingMethods:
    def embed(self, prompts, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              use_tqdm: bool | None = None, *, truncate_prompt_tokens: int | None = None,
              priority: Seq[int] | None = None, prompt_name: str | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt, in order (`output.outputs.embedding`), from an embedding
        model (a sentence-transformers folder or bare backbone, an encoder, or
        runner="pooling"). `pooling_params`: one for all prompts or one per prompt
        (dimensions, normalize); `truncate_prompt_tokens`: keep each prompt's last k tokens;
        `prompt_name`: one of the model's named prompts (config_sentence_transformers.json,
        e.g. "query") put before each text, as sentence-transformers' encode does."""
        self._require_task("embed", "LLM.embed")
        if prompt_name is not None:
            prompts = self._with_named_prompt(prompts, prompt_name)
        return self._pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, priority, "Embedding")

    def _with_named_prompt(self, prompts, name: str) -> list[str]:
        named = self.engine.pooler_config.prompts
        if name not in named:
            raise ValueError(f"prompt_name {name!r} is not one of the model's prompts "
                             f"({', '.join(map(repr, named)) or 'none'}; config_sentence_transformers.json)")
        texts = self._prompt_list(prompts)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt_name applies to text prompts, not token ids")
        return [named[name] + text for text in texts]

    def classify(self, prompts, use_tqdm: bool | None = None, *, truncate_prompt_tokens: int | None = None,
                 priority: Seq[int] | None = None) -> list[ClassificationRequestOutput]:
        """A sequence classifier's label probabilities per prompt (`output.outputs.probs`, in
        the order of the config's id2label; one label: the sigmoid of its logit)."""
        self._require_task("classify", "LLM.classify")
        outs = self._pool(prompts, None, use_tqdm, truncate_prompt_tokens, priority, "Classifying")
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(label_probabilities(o.outputs.data).tolist()))
                for o in outs]

    def score(self, data_1, data_2, use_tqdm: bool | None = None, *, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Text pairs' scores (vLLM's LLM.score): one text with each of `data_2`, or
        `data_1[i]` with `data_2[i]`; one output per pair, in order. An embedding model
        scores by the cosine of the two embeddings, a cross-encoder by reading the pair
        (`truncate_prompt_tokens` then cuts the second text to fit that many tokens)."""
        first, second = self._prompt_list(data_1), self._prompt_list(data_2)
        pairs = pair_indices(len(first), len(second))
        config = self.engine.pooler_config
        if config is not None and config.task == "classify":
            cut = None if truncate_prompt_tokens is None or truncate_prompt_tokens < 0 else truncate_prompt_tokens
            prompts = cross_encoder_prompts(self.tokenizer, first, second, pairs, config,
                                            cut or self.engine.max_model_len)
            outs = self._run(prompts, [PoolingParams()] * len(prompts), use_tqdm, [None] * len(prompts),
                             [0] * len(prompts), what="Scoring")
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                         ScoringOutput(cross_encoder_score(o.outputs.data, config))) for o in outs]
        outs = self.embed(first + second, pooling_params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        vectors = [o.outputs.data for o in outs]
        scores = cosine_scores(vectors[:len(first)], vectors[len(first):], pairs)
        return [ScoringRequestOutput(f"score-{next(self._ids)}",
                                     outs[i].prompt_token_ids + outs[len(first) + j].prompt_token_ids,
                                     ScoringOutput(score)) for (i, j), score in zip(pairs, scores)]

    def _require_task(self, task: str, method: str) -> None:
        config = self.engine.pooler_config
        if config is None:
            raise ValueError(f"{method} needs an embedding model or a classifier: this one generates text (LLM(model, "
                             "runner='pooling') pools any text model's hidden states)")
        if config.task != task:
            raise ValueError(f"{method} needs a{'n embedding model' if task == 'embed' else ' classifier'}; this "
                             f"model {'classifies (LLM.classify, LLM.score)' if config.task == 'classify' else 'embeds'}")

    def _pool(self, prompts, pooling_params, use_tqdm, truncate_prompt_tokens, priority, what: str):
        prompts = self._prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} pooling params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params_list = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        return self._run(prompts, params_list, use_tqdm, [None] * len(prompts),
                         self._priorities(priority, len(prompts)), what=what)

