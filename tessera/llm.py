"""Offline inference in the shape vLLM users know: LLM(model).generate(prompts, params)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence as Seq

from tqdm.auto import tqdm

from tessera.config import (CacheConfig, ConfigError, EngineConfig, LoRAConfig, ModelConfig,
                            ParallelConfig, SchedulerConfig, SpeculativeConfig, WatermarkConfig,
                            scheduler_defaults, speculative_config_from)
from tessera.engine.engine import Engine
from tessera.engine.outputs import RequestOutput
from tessera.lora.request import LoRARequest
from tessera.multimodal.chat import ContentPartError, template_content
from tessera.platform import async_scheduling_default, resolve_device
from tessera.llm_beam_search import BeamSearchMethods
from tessera.llm_pooling import PoolingMethods
from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams
from tessera.sampling.params import SamplingParams
from tessera.sampling.watermark import DEFAULT_Z_THRESHOLD, WatermarkScore, detect_watermark_in_output

# a text, token ids, or vLLM's prompt dicts: {"prompt": text} / {"prompt_token_ids": ids},
# {"prompt": text, "multi_modal_data": {"image": image or [images]}}
Prompt = str | list[int] | dict
Message = dict[str, Any]
# one adapter for every prompt, or one (or None) per prompt: a LoRARequest (loaded on first
# use) or the name of a loaded adapter (lora_modules)
LoRAArg = LoRARequest | str | Seq[LoRARequest | str | None] | None
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class ChatTemplateError(ValueError):
    pass


@dataclass
class ImagePrompt:
    """A prompt with images: its text holds the model's image placeholders (one per image)."""
    text: str
    images: list
    add_special_tokens: bool = True


def _unwrap_prompt(prompt: Prompt) -> str | list[int] | ImagePrompt:
    """A dict prompt's text, token ids or text with images; other prompts as they are."""
    if not isinstance(prompt, dict):
        return prompt
    if "multi_modal_data" in prompt:
        return _image_prompt(prompt)
    keys = set(prompt)
    if len(keys) != 1 or not keys <= set(PROMPT_KEYS):
        raise ValueError(f"a prompt dict holds exactly one of {', '.join(map(repr, PROMPT_KEYS))}; "
                         f"got keys {sorted(keys)}")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"'prompt' is text; got {type(prompt['prompt']).__name__} "
                             "(token ids go in 'prompt_token_ids')")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, (str, bytes)):
        raise ValueError("'prompt_token_ids' is a list of token ids; text goes in 'prompt'")
    return list(ids)


def _image_prompt(prompt: dict) -> ImagePrompt:
    data, text = prompt["multi_modal_data"], prompt.get("prompt")
    if set(prompt) != {"prompt", "multi_modal_data"} or not isinstance(text, str):
        raise ValueError('a prompt with images is {"prompt": text, "multi_modal_data": {"image": ...}}')
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes images only ({{'image': image or [images]}}); got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image")
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    return ImagePrompt(text, images)


def engine_config(model: str | Path | None = None, *, dtype: str = "auto",
                  tokenizer: str | None = None, max_model_len: int | None = None,
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                  block_size: int = 16, kv_cache_dtype: str = "auto",
                  num_kv_blocks: int | None = None, memory_fraction: float | None = None,
                  device: str = "auto", seed: int = 0, chat_template: str | None = None,
                  cache_dir: str | Path | None = None, logprobs_mode: str = "raw",
                  model_impl: str = "auto", load_format: str = "auto", quantization: str | None = None,
                  enforce_eager: bool = False, generation_config: str = "auto",
                  mm_processor_kwargs: dict | None = None, mmproj: str | Path | None = None,
                  runner: str = "auto", pooler_config: dict | None = None,
                  async_scheduling: bool | None = None,
                  scheduling_policy: str = "fcfs",
                  speculative_config: SpeculativeConfig | dict | None = None,
                  tensor_parallel_size: int = 1,
                  parallel: ParallelConfig | None = None,
                  enable_lora: bool = False, max_loras: int = 4, max_lora_rank: int = 16,
                  lora_modules: dict[str, str] | None = None,
                  watermark: WatermarkConfig | dict | None = None,
                  gpu_memory_utilization: float | None = None,
                  trust_remote_code: bool = False) -> EngineConfig:
    """The EngineConfig that `LLM(model, **kwargs)` runs (LLM's keyword arguments).
    `max_num_seqs` / `max_num_batched_tokens` left None take the device's defaults
    (config.scheduler_defaults); `device` "auto" is the GPU when torch sees one, and
    `async_scheduling` left None is on there (platform.async_scheduling_default).
    vLLM's `gpu_memory_utilization` is taken as `memory_fraction` (the share of free memory
    the KV cache gets); `trust_remote_code` is accepted for vLLM code and changes nothing:
    tessera never runs code from a checkpoint."""
    if gpu_memory_utilization is not None:
        if memory_fraction is not None and memory_fraction != gpu_memory_utilization:
            raise ConfigError("give memory_fraction or vLLM's gpu_memory_utilization, not both")
        memory_fraction = gpu_memory_utilization
    parallel = parallel or ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    # ranks launched per node (torchrun) each run on this machine alone
    device = resolve_device(device, 1 if parallel.launched else parallel.tensor_parallel_size)
    max_num_seqs, max_num_batched_tokens = scheduler_defaults(device, max_num_seqs, max_num_batched_tokens)
    speculative = speculative_config_from(speculative_config, device)
    if async_scheduling is None:
        async_scheduling = async_scheduling_default(device, speculative.enabled, parallel.tensor_parallel_size)
    model_config = ModelConfig(model=None if model is None else str(model), tokenizer=tokenizer,
                               dtype=dtype, max_model_len=max_model_len,
                               chat_template=chat_template, model_impl=model_impl,
                               load_format=load_format, quantization=quantization,
                               enforce_eager=enforce_eager, generation_config=generation_config,
                               mm_processor_kwargs=mm_processor_kwargs, runner=runner,
                               pooler_config=pooler_config, mmproj=None if mmproj is None else str(mmproj))
    if cache_dir is not None:
        model_config.cache_dir = Path(cache_dir)
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size=block_size, memory_fraction=memory_fraction,
                          num_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=enable_chunked_prefill,
                                  async_scheduling=async_scheduling,
                                  scheduling_policy=scheduling_policy),
        parallel=parallel, speculative=speculative,
        lora=LoRAConfig(enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
                        lora_modules=dict(lora_modules or {})),
        device=device, seed=seed, logprobs_mode=logprobs_mode,
        watermark=_watermark_config(watermark))


def _watermark_config(watermark: WatermarkConfig | dict | None) -> WatermarkConfig:
    if isinstance(watermark, WatermarkConfig):
        return watermark
    if watermark is not None and (not isinstance(watermark, dict) or not set(watermark) <= {"gamma", "delta", "key"}):
        got = sorted(watermark) if isinstance(watermark, dict) else type(watermark).__name__  # not the key
        raise ConfigError(f"watermark takes a WatermarkConfig or a dict of gamma, delta and key; got {got}")
    return WatermarkConfig(**(watermark or {}))


class LLM(PoolingMethods, BeamSearchMethods):
    """`model=None` loads the embedded default model (SmolLM2-135M-Instruct). Keyword
    arguments are engine_config's; `tensor_parallel_size` > 1 shards the model over that
    many ranks started on this machine, `parallel` gives the whole ParallelConfig (ports,
    ranks launched on several machines). Close it (or use `with`) to stop the ranks."""

    def __init__(self, model: str | Path | None = None, *, show_progress: bool = True,
                 config: EngineConfig | None = None, **kwargs):
        if config is not None and (model is not None or kwargs):
            raise TypeError("pass either a ready EngineConfig or model and keyword arguments, not both")
        config = config or engine_config(model, **kwargs)
        self.show_progress = show_progress
        self.engine = Engine(config, show_progress=show_progress)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also stop when this process exits)."""
        self.engine.close()

    def reset_prefix_cache(self) -> int:
        """Forget cached prompt prefixes (e.g. between benchmark repeats of the same prompts)."""
        return self.engine.reset_prefix_cache()

    def reset_mm_cache(self) -> int:
        """Forget the encoded images kept across requests (vLLM's LLM.reset_mm_cache), so
        the next prompt with a picture seen before encodes it again; returns how many."""
        return self.engine.reset_mm_cache()

    def detect_watermark(self, output: str | Seq[int], *, prompt: str | Seq[int] | None = None,
                         z_threshold: float = DEFAULT_Z_THRESHOLD,
                         ignore_repeated_bigrams: bool = False) -> WatermarkScore:
        """Whether a generated output (its text, or better its token_ids) carries this
        engine's watermark: a z-test of its green tokens. Pass the `prompt` it answered
        (text, or a RequestOutput's prompt_token_ids) to score its first token too."""
        return detect_watermark_in_output(self.tokenizer, self.engine.router.config.vocab_size,
                                          self.engine.config.watermark, output, prompt=prompt,
                                          z_threshold=z_threshold,
                                          ignore_repeated_bigrams=ignore_repeated_bigrams)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, lora_request: LoRAArg = None,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of token ids,
        or vLLM's dict forms {"prompt": text} and {"prompt_token_ids": ids};
        `sampling_params` is one SamplingParams for all prompts or one per prompt, and so is
        `lora_request` (the adapter to run with; needs enable_lora). `priority`: one per
        prompt, lower sooner (needs scheduling_policy="priority")."""
        prompts, params_list = self._pair(prompts, sampling_params)
        return self._run(prompts, params_list, use_tqdm, self._loras(lora_request, len(prompts)),
                         self._priorities(priority, len(prompts)))

    def generate_stream(self, prompts: Prompt | Seq[Prompt],
                        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                        lora_request: LoRAArg = None,
                        priority: Seq[int] | None = None) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, RequestOutput) as the engine produces them: each carries
        the text, token ids and logprobs its step added (`outputs[j].delta_text`, ...),
        and the last one of a prompt has `finished=True`. Stopping the iteration early
        aborts the requests still running."""
        prompts, params_list = self._pair(prompts, sampling_params)
        ids = self._add(prompts, params_list, self._loras(lora_request, len(prompts)),
                        self._priorities(priority, len(prompts)))
        index = {request_id: i for i, request_id in enumerate(ids)}
        try:
            for out in self.engine.iter_outputs(ids):
                yield index[out.request_id], out
        finally:  # closed early, or a step raised: free whatever is still running
            for request_id in ids:
                self.engine.abort(request_id)

    @staticmethod
    def _prompt_list(prompts: Prompt | Seq[Prompt]) -> list[str | list[int] | ImagePrompt]:
        if isinstance(prompts, (str, dict, ImagePrompt)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [_unwrap_prompt(p) for p in prompts]

    def _pair(self, prompts: Prompt | Seq[Prompt], sampling_params) -> tuple[list[Prompt], list[SamplingParams]]:
        prompts = self._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        return prompts, params_list

    @staticmethod
    def _loras(lora_request: LoRAArg, num_prompts: int) -> list[LoRARequest | str | None]:
        if lora_request is None or isinstance(lora_request, (LoRARequest, str)):
            return [lora_request] * num_prompts
        loras = list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(f"{len(loras)} LoRA requests for {num_prompts} prompts")
        return loras

    @staticmethod
    def _priorities(priority: Seq[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        priorities = [priority] if isinstance(priority, int) else list(priority)
        if len(priorities) != num_prompts:
            raise ValueError(f"priority takes one integer per prompt ({num_prompts}), got {priority!r}")
        return priorities

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | None = None, lora_request: LoRAArg = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`, else --chat-template, else the
        tokenizer's) and generate; the arguments are vLLM's LLM.chat's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, add_generation_prompt, chat_template=chat_template,
                                    continue_final_message=continue_final_message, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def chat_prompt(self, messages: list[Message], add_generation_prompt: bool = True,
                    **kwargs) -> list[int] | ImagePrompt:
        """A conversation's prompt for `generate`: token ids, or, when its messages hold
        images (content parts), the rendered text with its images. `kwargs`: those of
        apply_chat_template."""
        takes_images = self.engine.supports_images
        rendered, images = [], []
        try:
            for m in messages:
                content, found = template_content(m.get("content"), takes_images)
                rendered.append({**m, "content": content} if found or takes_images else m)
                images += found
        except ContentPartError as exc:
            raise ValueError(str(exc)) from exc
        if not images:
            return self.apply_chat_template(rendered, add_generation_prompt, **kwargs)
        text = self._render_chat(rendered, add_generation_prompt, **kwargs)
        return ImagePrompt(text, images, add_special_tokens=False)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        text = self._render_chat(messages, add_generation_prompt, chat_template=chat_template,
                                 continue_final_message=continue_final_message, tools=tools,
                                 chat_template_kwargs=chat_template_kwargs)
        # The template already holds any BOS token; do not add special tokens twice.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _render_chat(self, messages: list[Message], add_generation_prompt: bool = True, *,
                     chat_template: str | None = None, continue_final_message: bool = False,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
        template = chat_template or self.engine.router.chat_template
        if not template:
            raise ChatTemplateError("this model's tokenizer has no chat template; pass one with "
                                    "--chat-template FILE (or LLM(chat_template=...))")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(pass add_generation_prompt=False to continue the last message)")
        return self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, tools=tools,
                                                  **(chat_template_kwargs or {}))

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate / chat use without sampling_params: the model's generation_config
        sampling defaults (vLLM's), else SamplingParams()."""
        return SamplingParams(**self.engine.router.sampling_defaults)

    def get_tokenizer(self):
        """The tokenizer (vLLM's LLM.get_tokenizer)."""
        return self.tokenizer

    def _add(self, prompts: list[Prompt], params: list[SamplingParams],
             loras: list[LoRARequest | str | None], priorities: list[int]) -> list[str]:
        """Queue every prompt, or none of them (a bad one aborts those already queued)."""
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, lora, priority in zip(ids, prompts, params, loras, priorities):
                images = None
                if isinstance(prompt, ImagePrompt):
                    prompt, images = engine.process_images(prompt.text, prompt.images, prompt.add_special_tokens)
                engine.add_request(request_id, prompt, p, lora, priority, multimodal=images)
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            raise
        return ids

    def _run(self, prompts: list[Prompt], params: list[SamplingParams] | list[PoolingParams],
             use_tqdm: bool | None, loras: list[LoRARequest | str | None], priorities: list[int],
             what: str = "Generating") -> list[RequestOutput] | list[PoolingRequestOutput]:
        engine = self.engine
        ids = self._add(prompts, params, loras, priorities)
        finished: dict[str, RequestOutput] = {}
        show = self.show_progress if use_tqdm is None else use_tqdm
        try:
            with tqdm(total=len(prompts), desc=what, unit=" prompts", disable=not show) as bar:
                for out in engine.iter_outputs(ids, stream=False):
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a failed or interrupted run must not leave requests holding blocks
            for request_id in ids:
                engine.abort(request_id)
            raise
        return [finished[i] for i in ids]
