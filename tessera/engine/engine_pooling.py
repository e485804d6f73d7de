"""The engine's embedding (pooling) requests: queued as one sequence each, finished with one
output when their prompt is computed (mixed into tessera.engine.engine.Engine; the checks
and the sequence itself are engine/pooling_requests.py's)."""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from tessera.engine.image_requests import check_image_request
from tessera.engine.pooling_requests import pooled_output, pooling_sequence
from tessera.engine.request_checks import RequestError
from tessera.engine.sequence import Sequence
from tessera.multimodal.inputs import MultimodalInputs
from tessera.pooling.config import PoolerConfig
from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams, TokenTypedPrompt


class PoolingRequests:
    pooler_config: PoolerConfig | None  # None: the engine generates

    @property
    def is_pooling(self) -> bool:
        """Whether this engine serves embeddings (PoolingParams requests) instead of text."""
        return self.pooler_config is not None

    def _add_pooling_request(self, request_id: str, prompt: str | Seq[int] | TokenTypedPrompt,
                             params: PoolingParams, priority: int, multimodal: MultimodalInputs | None) -> Sequence:
        if multimodal is not None:
            if not self.router.supports_images:
                raise RequestError("this embedding model takes text only")
            if params.truncate_prompt_tokens is not None:
                raise RequestError("truncate_prompt_tokens cannot cut a prompt with images (an image's tokens "
                                   "come whole)", param="truncate_prompt_tokens")
            check_image_request(multimodal, isinstance(prompt, str), [] if isinstance(prompt, str) else list(prompt))
        seq = pooling_sequence(request_id, prompt, params, self.pooler_config, self.router, self.max_model_len)
        seq.multimodal = multimodal
        seq.priority = priority
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _finish_pooled(self, pooled: list[tuple[Sequence, torch.Tensor]], now: float) -> list[PoolingRequestOutput]:
        """End the sequences a step pooled (unless aborted meanwhile); their outputs."""
        outputs = []
        for seq, vector in pooled:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
                outputs.append(pooled_output(seq, vector, now))
        return outputs
