"""The engine: one API (add_request / step / abort) for the offline LLM and the server.

Construction resolves the model's router, builds the model from registered ops, loads its
weights, sizes the paged KV cache by a warm-up step, and sets up the scheduler.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Collection, Iterator, Sequence as Seq

import torch

from tessera.config import EngineConfig
from tessera.distributed.channel import StepChannel
from tessera.engine.block_manager import BlockManager
from tessera.engine.config_checks import check_engine_config
from tessera.engine.engine_beams import BeamSearchMethods
from tessera.engine.engine_lora import LoRAMethods
from tessera.engine.engine_parallel import TensorParallelMethods
from tessera.engine.engine_pooling import PoolingRequests
from tessera.engine.image_requests import check_image_request, image_placeholder, process_images
from tessera.engine.model_loading import load_model
from tessera.engine.output_processor import Delta, OutputProcessor
from tessera.engine.outputs import RequestOutput
from tessera.engine.pooling_requests import resolve_pooler, wrong_kind
from tessera.engine.request_checks import RequestError, check_against_vocab, check_priority, check_prompt
from tessera.engine.scheduler import Scheduler
from tessera.engine.sequence import FinishReason, Sequence, SequenceGroup
from tessera.engine.config_checks import check_recurrent_model
from tessera.engine.speculation import find_draft_model, load_draft_model, make_proposer
from tessera.engine.state_cache import StateCache, num_state_slots
from tessera.engine.stats import EngineStats
from tessera.engine.thinking_budget import thinking_budget
from tessera.lora.registry import LoRARegistry, adapter_names
from tessera.lora.request import LoRARequest
from tessera.models.registry import get_router
from tessera.multimodal.inputs import MultimodalInputs
from tessera.ops.attention.kv_quant import kv_cache_torch_dtype
from tessera.ops.registry import OpTarget
from tessera.platform import resolve_weights
from tessera.pooling.params import PoolingParams
from tessera.pooling.pooler import Pooler
from tessera.runner.graph_inputs import GraphLimits
from tessera.runner.launched_step import LaunchedStep, StepResult
from tessera.runner.model_runner import ModelRunner
from tessera.runner.warmup import max_decode_rows, size_kv_cache
from tessera.sampling.bad_words import bad_words_token_ids
from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import Sampler
from tessera.sampling.structured import GrammarCompiler, StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger(__name__)


class Engine(LoRAMethods, PoolingRequests, TensorParallelMethods, BeamSearchMethods):
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        self.router = get_router(config.model)
        self.tokenizer = self.router.tokenizer
        self.device = torch.device(config.device)
        # the model dtype and the linear layers' weight format (--quantization made concrete)
        self.dtype, self.quantization = resolve_weights(
            config.model.dtype, config.model.quantization, config.device, self.router.implementation == "native",
            self.router.stored_matrix_format)
        if self.quantization and config.model.quantization is None:
            how = ("as stored, in int4" if self.quantization == "int4"
                   else "in int8, in groups of 32 as Q8_0 keeps them")
            logger.info("the GGUF stores its weight matrices as %s: they run %s (--quantization none loads "
                        "them dequantized to %s)", self.router.stored_matrix_format, how,
                        str(self.dtype).removeprefix("torch."))
        self.max_model_len = self.router.max_model_len
        check_engine_config(config, self.router, self.max_model_len)
        # an embedding model's pooling (--runner pooling); None: the engine generates
        self.pooler_config = resolve_pooler(config, self.router)
        self.draft = find_draft_model(config, self.router)
        self._start_group(config)
        try:
            self._build(config, show_progress)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, show_progress: bool) -> None:
        tp = config.parallel.tensor_parallel_size
        target = OpTarget(self.device.type, self.dtype, tp_size=tp, tp_rank=0,
                          quant=self.quantization,
                          kv_cache_dtype=kv_cache_torch_dtype(config.cache.kv_cache_dtype))
        pooling = self.pooler_config is not None
        self.model = load_model(self.router, target, show_progress, pooling=self.pooler_config)
        # a GPU sorts a whole vocabulary fast; the CPU's top-p first tries the best 256 tokens
        sampler = None if pooling else Sampler(config.seed, self.router.eos_token_ids, config.logprobs_mode,
                                               top_p_prefix=None if self.device.type == "cuda" else 256,
                                               watermark=config.watermark)
        channel = StepChannel(self.device) if self.tp_group is not None else None
        self.runner = ModelRunner(self.model, config.cache.block_size, self.device, self.dtype,
                                  sampler, channel=channel,
                                  ranks_sharing_memory=tp if self.device.type == "cpu" else 1,
                                  decode_graphs=self._decode_graphs(config) and not pooling,
                                  pooler=Pooler(self.pooler_config) if pooling else None,
                                  num_state_slots=num_state_slots(config.scheduler.max_num_seqs,
                                                                  config.cache.enable_prefix_caching))
        check_recurrent_model(config, self.runner)
        lora = config.lora
        self.loras = LoRARegistry(self.model, lora.max_lora_rank, self.dtype) if lora.enable_lora else None
        if self.loras is not None:  # slots first: the KV cache gets what they leave
            self.runner.enable_lora(lora.max_loras, lora.max_lora_rank)
            for name, path in lora.lora_modules.items():
                self.loras.add(LoRARequest(name, len(self.loras.adapters()) + 1, path))
        if self.draft is not None:
            load_draft_model(self.draft, config, self.device, show_progress)
        self.num_blocks, self.max_model_len = size_kv_cache(
            self.runner, config, self.max_model_len, None if self.draft is None else self.draft.sizing,
            self.router.image_prompts.largest_image_inputs if self.router.supports_images else None,
            self.router.longest_attention_span)
        self.runner.graph_limits = GraphLimits(max_decode_rows(config), self.max_model_len)
        self.runner.allocate_kv_cache(self.num_blocks)
        self.proposer = make_proposer(config, self.draft, self.router.config.vocab_size,
                                      self.num_blocks, self.max_model_len)
        recurrent = bool(self.runner.state_layers)
        self.block_manager = BlockManager(self.num_blocks, config.cache.block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching)
        seqs = config.scheduler.max_num_seqs  # snapshots take the slots after the running sequences'
        state_cache = StateCache(seqs, seqs) if recurrent and config.cache.enable_prefix_caching else None
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   max_loras=lora.max_loras if lora.enable_lora else None, state_slots=recurrent,
                                   state_cache=state_cache)
        self.output_processor = OutputProcessor(self.tokenizer, self.router.eos_token_ids)
        # request id -> its first sequence (`seq.group` holds all n / best_of of them)
        self.requests: dict[str, Sequence] = {}
        self._in_flight: LaunchedStep | None = None  # async scheduling: the step launched last
        self._undelivered: list[RequestOutput] = []  # processed before a launch that raised
        self._grammars: GrammarCompiler | None = None  # structured outputs, built on first use
        self._grammars_lock = threading.Lock()
        self._spec_counts = [0, 0, 0]  # steps of a sequence with drafts, drafts, accepted drafts
        self._beam_requests: set[str] = set()  # running beam searches: their steps run synchronously

    def _decode_graphs(self, config: EngineConfig) -> bool:
        """Captured decode graphs (CPU kernel graphs, CUDA graphs): one rank only (a replay
        cannot join a collective), not with --enforce-eager."""
        return not config.model.enforce_eager and self.tp_group is None

    # --- requests -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    @property
    def supports_images(self) -> bool:
        return self.router.supports_images

    @property
    def image_placeholder(self) -> str | None:
        """What a prompt writes where an image goes (the model's own, e.g. <image>)."""
        return image_placeholder(self.router)

    def process_images(self, prompt: str, images: Seq, add_special_tokens: bool = True
                       ) -> tuple[list[int], MultimodalInputs | None]:
        """A prompt with image placeholders (chat templates write them) and its images: its
        token ids and images' inputs for add_request (engine/image_requests.py)."""
        return process_images(self.router, self.tokenizer, prompt, images, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | PoolingParams | None = None,
                    lora_request: LoRARequest | str | None = None, priority: int = 0,
                    multimodal: MultimodalInputs | None = None) -> Sequence:
        """Queue a request; returns its first sequence (all of them: `seq.group.seqs`).
        `lora_request`: the adapter to run it with, a LoRARequest (loaded on first use) or
        the name of a loaded one. `priority`: under the "priority" scheduling policy, lower
        runs sooner (any other value than 0 needs that policy).

        With n / best_of > 1 the request runs as that many independent sequences (seeds
        seed, seed + 1, ... when a seed is given). The first one is scheduled at once; the
        others join when it has computed the prompt, so that they reuse its cached prompt
        blocks instead of computing the prompt again.

        An embedding engine (`is_pooling`) takes PoolingParams: the request ends with one
        PoolingRequestOutput once its prompt is computed."""
        params = params or (PoolingParams() if self.is_pooling else SamplingParams())
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        check_priority(priority, self.scheduler.by_priority)
        mismatch = wrong_kind(params, self.is_pooling)
        if mismatch is not None:
            raise mismatch
        if self.is_pooling:
            return self._add_pooling_request(request_id, prompt, params, priority, multimodal)
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_image_request(multimodal, text is not None, token_ids)
        vocab = self.router.config.vocab_size
        check_prompt(token_ids, vocab, self.max_model_len)
        check_against_vocab(params, vocab)
        if params.use_beam_search:
            self._check_beam_request(params, len(token_ids))
        # tokenized per request (the caller may have changed bad_words on a reused object)
        params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else None
        lora = self._resolve_lora(lora_request)
        seqs = []
        for index in range(1 if params.use_beam_search else params.num_sequences):  # (beams fork from one)
            seed = params.child_seed(index)
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            seqs.append(Sequence(request_id, text, token_ids, params, self.max_model_len,
                                 generator, index=index, lora=lora, multimodal=multimodal))
            seqs[-1].thinking = thinking_budget(params)  # each sample counts its own
        if params.structured_outputs is not None:  # compiled once, a matcher per sequence
            compiled = self.compile_grammar(params.structured_outputs)
            for seq in seqs:
                seq.grammar = self._grammars.matcher(compiled)
                if params.reasoning_end_token_id is not None:  # a reasoning comes first
                    seq.grammar_may_open = params.reasoning_start_token_id
                    seq.grammar_waits = seq.grammar_may_open is None  # the output starts in it
        group = SequenceGroup(request_id, seqs, pending=seqs[1:])
        if params.use_beam_search:
            group.beams = self._new_beam_search(params)
            self._beam_requests.add(request_id)
        for seq in seqs:
            seq.group = group
            seq.arrival_time = seqs[0].arrival_time
            seq.priority = priority
        self.requests[request_id] = seqs[0]
        self.scheduler.add(seqs[0])
        return seqs[0]

    def compile_grammar(self, spec: StructuredOutputsParams):
        """Compile a structured-output constraint (cached); any thread may call this, so a
        server compiles before handing the request to the engine thread."""
        try:
            with self._grammars_lock:
                if self._grammars is None:  # on the first constrained request
                    self._grammars = GrammarCompiler(self.tokenizer, self.router.config.vocab_size,
                                                     self.router.eos_token_ids)
            return self._grammars.compile(spec)
        except StructuredOutputError as exc:
            raise RequestError(str(exc)) from exc

    def abort(self, request_id: str) -> bool:
        """Drop a request (all its sequences) wherever it is; its blocks are freed at once."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        for s in seq.group.seqs:
            if not s.is_finished:
                s.finish_reason = FinishReason.ABORT
                self.scheduler.finish(s)
        seq.group.pending.clear()
        self._beam_requests.discard(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._undelivered)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no request holds (vLLM's call of this name refuses
        while blocks are in use; this resets what it can); returns the blocks forgotten.
        A model with recurrent layers forgets its state snapshots too."""
        if self.scheduler.state_cache is not None:
            self.scheduler.state_cache.reset()
        return self.block_manager.reset_prefix_cache()

    def reset_mm_cache(self) -> int:
        """Forget the encoded images kept across requests (vLLM's name); returns how many."""
        return self.runner.encoder_cache.clear()

    def stats(self) -> EngineStats:
        """A snapshot of load and cache counters (what the server's /metrics publishes)."""
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=bm.usage, num_kv_blocks=bm.num_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            spec_num_drafts=self._spec_counts[0], spec_draft_tokens=self._spec_counts[1],
            spec_accepted_tokens=self._spec_counts[2],
            # stats() runs on the server's thread while the engine thread changes the queues:
            # copies made in C (list(...)) never see them half-changed
            lora_running=adapter_names(list(sched.running)) if self.loras is not None else (),
            lora_waiting=adapter_names(list(sched.waiting)) if self.loras is not None else (),
            max_loras=self.config.lora.max_loras if self.loras is not None else 0)

    # --- the loop ---------------------------------------------------------------------------

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that got a new token
        (see outputs.py for what a RequestOutput holds while streaming and at the end).
        With `stream=False` only requests that finished are reported: offline callers that
        keep only final outputs skip building one per request per step (its token ids and
        text copied each time: quadratic in the output length).

        With async scheduling a call launches the next step first and then reports the
        tokens of the step launched by the previous call."""
        if self.config.scheduler.async_scheduling and not self.is_pooling:
            if not self._beam_requests:
                return self._step_async(stream)
            if self._in_flight is not None or self._undelivered:  # beams pick tokens on the host: end
                return self._step_async(stream, launch=False)   # the launched step before a synchronous one
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._check_progress()
            return []
        if self.proposer is not None:
            self.proposer.fill(plan.scheduled)
        result = self._execute(plan.scheduled)
        self.scheduler.step_done(plan, result.num_rejected)
        if result.num_rejected:
            self._count_speculation(plan, result.num_rejected)
        return self._process(result, stream)

    def _count_speculation(self, plan, num_rejected: dict[Sequence, int]) -> None:
        for item in plan.scheduled:
            if item.draft_token_ids:
                drafts = len(item.draft_token_ids)
                self._spec_counts[0] += 1
                self._spec_counts[1] += drafts
                self._spec_counts[2] += drafts - num_rejected.get(item.seq, drafts)

    def _step_async(self, stream: bool, launch: bool = True) -> list[RequestOutput]:
        """Schedule step N+1 while step N runs: its rows whose token N is sampling read it
        on the device; then wait for N's tokens and process them. A sequence that N
        finishes (EOS, stop string) has already been given a row in N+1, whose token is
        dropped; a step whose sampling needs those tokens on the host (penalties,
        min_tokens) first waits for N."""
        plan = self.scheduler.schedule() if launch else None
        previous, outputs, drained = self._in_flight, self._undelivered, False
        if plan is None:  # only the step in flight, and what an earlier call left
            self._in_flight, self._undelivered = None, []
            return outputs + (self._process(previous.result(), stream) if previous is not None else [])
        self._undelivered = []
        if previous is not None and any(item.seq.num_pending_tokens and item.seq.params.needs_token_history
                                        for item in plan.scheduled):
            self._in_flight, drained = None, True
            outputs = outputs + self._process(previous.result(), stream)
            previous = None
            plan.scheduled = [item for item in plan.scheduled if not item.seq.is_finished]
        if plan.is_empty:
            if previous is None:
                if not drained:
                    self._check_progress()
                return outputs
            self._in_flight = None
            return outputs + self._process(previous.result(), stream)
        if self._fatal is not None:
            raise self._fatal
        try:
            launched = self.runner.launch(plan.scheduled, previous)
        except BaseException:
            self._undelivered = outputs  # a drained step's outputs come with the next call
            raise
        for item in launched.inputs.sampled_rows:
            item.seq.num_pending_tokens += 1
        self._in_flight = launched
        if previous is not None:
            outputs = outputs + self._process(previous.result(), stream)
        self.scheduler.step_done(plan)  # after N's tokens: full blocks' hashes need them
        if not launched.inputs.prompt_rows and all(s.seq.is_finished for s in launched.inputs.sampled_rows):
            self._in_flight = None  # only wasted rows: nothing to wait for
        return outputs

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress with requests pending "
                               f"({self.block_manager.num_free_blocks} free blocks)")

    def _process(self, result: StepResult, stream: bool) -> list[RequestOutput]:
        """Append a step's sampled tokens, finish what they end, and build the outputs."""
        now = time.monotonic()
        if result.pooled:  # a pooling engine's step: its finished prompts' outputs
            return self._finish_pooled(result.pooled, now)
        processor = self.output_processor
        for rows, infos in result.prompt_logprobs:
            processor.record_prompt_logprobs(rows.item.seq, rows.start, infos)
        progressed: dict[SequenceGroup, dict[Sequence, Delta]] = {}
        searching: dict[SequenceGroup, None] = {}  # beam searches whose beams this step advanced
        for sample in result.samples:
            seq = sample.item.seq
            if seq.num_pending_tokens:
                seq.num_pending_tokens -= 1
            if seq.is_finished:  # finished or aborted after this step was launched
                continue
            group = seq.group
            if group.beams is not None:  # its token is the search's to pick
                seq.beam_candidates = sample.beam_candidates
                searching[group] = None
                continue
            deltas = progressed.setdefault(group, {})
            text, ids = processor.append_token(seq, sample.token_id, sample.logprobs)
            if seq in deltas:  # accepted drafts: several tokens of one sequence in a step
                text, ids = deltas[seq][0] + text, deltas[seq][1] + ids
            deltas[seq] = text, ids
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            if group.pending:  # the first sequence has computed the prompt: fan out
                for child in reversed(group.pending):
                    self.scheduler.requeue(child)  # ahead of newer requests (of its priority)
                group.pending.clear()
        for group in searching:
            ended = self._advance_beams(group)
            if ended is not None:
                progressed[group] = ended
                self._beam_requests.discard(group.request_id)
        if self.proposer is not None:
            self._propose(progressed)
        outputs = []
        for group, deltas in progressed.items():
            if group.is_finished:
                self.requests.pop(group.request_id, None)
            elif not stream:
                continue
            outputs.append(processor.request_output(group, deltas, now))
        return outputs

    def _propose(self, progressed: dict[SequenceGroup, dict[Sequence, Delta]]) -> None:
        """Speculative decoding: drafts for the next step of every sequence this step
        advanced (not under a structured-output constraint or a thinking budget: a mask or a
        forced token holds for one position only)."""
        limit = self.proposer.config.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) + len(self.scheduler.waiting) > limit:
            return
        for deltas in progressed.values():
            for seq in deltas:
                if not seq.is_finished and seq.grammar is None and seq.thinking is None:
                    seq.draft_token_ids = self.proposer.propose(seq)

    def iter_outputs(self, request_ids: Collection[str] | None = None,
                     stream: bool = True) -> Iterator[RequestOutput]:
        """Step until the given requests (default: all) have finished, yielding their
        outputs as they come (with `stream=False`, only the final ones): the streaming view
        of step() for offline use. Other requests keep running; their outputs are not
        yielded."""
        wanted = None if request_ids is None else set(request_ids)
        remaining = None if wanted is None else {r for r in wanted if r in self.requests}
        while self.has_unfinished() and (remaining is None or remaining):
            for out in self.step(stream):
                if wanted is None or out.request_id in wanted:
                    if out.finished and remaining is not None:
                        remaining.discard(out.request_id)
                    yield out
