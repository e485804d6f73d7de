"""The engine: one API (add_request / step / abort) for the offline LLM and the server.

Construction resolves the model's router, builds the model from registered ops, loads its
weights, sizes the paged KV cache by a warm-up step, and sets up the scheduler.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence as Seq

import torch
from tqdm.auto import tqdm

from tessera.config import ConfigError, EngineConfig
from tessera.engine.block_manager import BlockManager
from tessera.engine.detokenizer import detokenize_incrementally, flush
from tessera.engine.outputs import CompletionOutput, RequestOutput
from tessera.engine.scheduler import Scheduler
from tessera.engine.sequence import FinishReason, Sequence, SequenceStatus
from tessera.engine.stats import EngineStats
from tessera.models.registry import get_router
from tessera.ops.registry import OpTarget
from tessera.platform import resolve_dtype
from tessera.runner.model_runner import ModelRunner
from tessera.runner.warmup import plan_kv_cache
from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import Sampler
from tessera.weights.loader import load_weights

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot take (empty, too long, duplicate id ...); nothing queued."""


class Engine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        self.router = get_router(config.model)
        self.tokenizer = self.router.tokenizer
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, config.device)
        self.max_model_len = self.router.max_model_len
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")
        target = OpTarget(self.device.type, self.dtype)
        started = time.perf_counter()
        self.model = self.router.build_model(target).eval()
        weights = tqdm(self.router.iter_weights(), desc="Loading weights", unit=" tensors",
                       disable=not show_progress, leave=False)
        load_weights(self.model, weights)
        logger.info("loaded %s (%s, %s) in %.1fs", self.router.source.name,
                    type(self.model).__name__, self.dtype, time.perf_counter() - started)
        self.runner = ModelRunner(self.model, config.cache.block_size, self.device, self.dtype,
                                  Sampler(config.seed))
        self.num_blocks = self._size_kv_cache()
        self.runner.allocate_kv_cache(self.num_blocks)
        self.block_manager = BlockManager(self.num_blocks, config.cache.block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.block_manager)
        self.requests: dict[str, Sequence] = {}

    def _size_kv_cache(self) -> int:
        cache, sched = self.config.cache, self.config.scheduler
        num_blocks = cache.num_blocks
        if num_blocks is None:
            plan = plan_kv_cache(self.runner, memory_fraction=cache.fraction_for(self.config.device),
                                 max_num_batched_tokens=sched.max_num_batched_tokens,
                                 max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len)
            num_blocks = plan.num_blocks
        capacity = num_blocks * cache.block_size
        if capacity < cache.block_size:
            raise ConfigError("not enough memory for even one KV cache block; "
                              "free memory or raise memory_fraction")
        if capacity < self.max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len %d: "
                           "clamping max_model_len to %d", capacity, self.max_model_len, capacity)
            self.max_model_len = capacity
        per_token = self.runner.kv_bytes_per_block() / cache.block_size
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %.0f KiB per token); "
                    "max_model_len %d", num_blocks, cache.block_size, capacity,
                    num_blocks * per_token * cache.block_size / 2**20, per_token / 1024,
                    self.max_model_len)
        return num_blocks

    # --- requests -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | None = None) -> Sequence:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise RequestError("prompt is empty")
        vocab = self.router.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                               f"{self.max_model_len}, leaving no room to generate")
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        seq = Sequence(request_id, text, token_ids, params, self.max_model_len, generator)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks are freed at once."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """A snapshot of load and cache counters (what the server's /metrics publishes)."""
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=bm.usage, num_kv_blocks=bm.num_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits)

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that got a new token."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending "
                                   f"({self.block_manager.num_free_blocks} free blocks)")
            return []
        results = self.runner.execute(plan.scheduled)
        self.scheduler.step_done(plan)
        now = time.monotonic()
        outputs = []
        for item, token in results:
            seq = item.seq
            seq.token_ids.append(token)
            delta = detokenize_incrementally(self.tokenizer, seq)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                delta += flush(self.tokenizer, seq)
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
            outputs.append(self._output(seq, delta, [token], now))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if not params.ignore_eos and token in self.router.eos_token_ids:
            return FinishReason.EOS
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_new_tokens or seq.num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _output(self, seq: Sequence, delta: str, delta_ids: list[int], now: float) -> RequestOutput:
        reason = seq.finish_reason.value if seq.finish_reason else None
        completion = CompletionOutput(0, seq.text, seq.output_token_ids, reason, delta, delta_ids)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             finished=seq.status is SequenceStatus.FINISHED,
                             metrics={"arrival_time": seq.arrival_time, "time": now})
