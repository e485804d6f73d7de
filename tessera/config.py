"""Typed, validated configuration. Environment variables are read only in cli.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
# native: a tessera model folder; transformers: transformers' modeling code with our paged
# attention; auto: native when a folder serves the type, else transformers
MODEL_IMPLS = ("auto", "native", "transformers")
# auto: the checkpoint's weights; dummy: seeded random weights for the config (benchmarking
# real shapes with nothing to download or read)
LOAD_FORMATS = ("auto", "dummy")
# auto: the model's generation_config.json sets the default sampling parameters (temperature,
# top_p, top_k, min_p, repetition_penalty, max_new_tokens) of requests that leave them out,
# and max_new_tokens caps OpenAI requests, as vLLM does; vllm: the engine's neutral defaults
GENERATION_CONFIGS = ("auto", "vllm")
# int8: linear weights quantized after loading (weight-only; activations stay in the model
# dtype), on CPU in groups of 32 as GGUF's Q8_0. About halves weight memory and single-stream
# decode's weight traffic. int4: in groups of 32 input features (GGUF's Q4_1 format), the LM
# head in int8: 5 bits per weight (tessera/ops/linear_int4.py). none: the model dtype. Unset
# (None): int4 for a GGUF stored as Q4_0 / Q4_1 / Q4_K on CPU, int8 for one stored as Q8_0 /
# Q6_K / Q5, else none (tessera/platform.py, resolve_weights).
QUANTIZATIONS = (None, "none", "int8", "int4")
# the KV cache's storage: the model dtype, or 8-bit floats (fp8 = fp8_e4m3 = TGI's
# fp8_e4m3fn; fp8_e5m2), half a bf16 cache (tessera/ops/attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e4m3fn", "fp8_e5m2")
SCHEDULING_POLICIES = ("fcfs", "priority")
# generate: text generation; pooling: embeddings (a prompt pooled into one vector, vLLM's
# --runner pooling); auto: pooling for sentence-transformers folders and bare backbones
RUNNERS = ("auto", "generate", "pooling")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent with another."""


def async_scheduling_conflict(speculative: bool, tensor_parallel_size: int) -> str | None:
    """Why async scheduling cannot run with these settings, or None: the engine refuses
    the combination when asked for it, and leaves async scheduling off by default."""
    if speculative:
        return ("async scheduling and speculative decoding do not combine: the next "
                "step's inputs depend on how many drafts the host accepts")
    if tensor_parallel_size > 1:
        return ("async scheduling runs one rank: the other ranks would need the "
                "sampled tokens before the driver has them")
    return None


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass
class ModelConfig:
    """What to load. `model=None` means the embedded default model (SmolLM2-135M-Instruct)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    chat_template: str | None = None
    model_impl: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    # run every step through the layers' Python (no captured decode graphs)
    enforce_eager: bool = False
    generation_config: str = "auto"
    # models that take images: settings for their image processor's calls (vLLM's
    # --mm-processor-kwargs, e.g. {"max_pixels": 1003520} for Qwen2-VL)
    mm_processor_kwargs: dict | None = None
    runner: str = "auto"
    # embedding models: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool,
    # "is_matryoshka": bool} over what the checkpoint's files say (tessera/pooling/config.py)
    pooler_config: dict | None = None
    # a GGUF model's multimodal projector file (llama.cpp's --mmproj): its images
    # (tessera/weights/gguf_mmproj.py)
    mmproj: str | None = None
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "tessera")

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.load_format in LOAD_FORMATS,
                 f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(self.generation_config in GENERATION_CONFIGS,
                 f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        _require(self.model_impl in MODEL_IMPLS,
                 f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _require(self.mm_processor_kwargs is None or isinstance(self.mm_processor_kwargs, dict),
                 f"mm_processor_kwargs must be a dict, got {self.mm_processor_kwargs!r}")
        _require(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        _require(self.pooler_config is None or isinstance(self.pooler_config, dict),
                 f"pooler_config must be a dict, got {self.pooler_config!r}")
        _require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be positive, got {self.max_model_len}")
        self.cache_dir = Path(self.cache_dir)


@dataclass
class CacheConfig:
    """Paged KV cache geometry. The cache gets `memory_fraction` of the memory still free
    after warm-up, less a step's peak activations; None means 0.9 on CUDA (the process owns the GPU) and 0.2 on CPU (the
    machine is shared with everything else; 4-5 GiB on a 24 GiB host). `num_blocks`
    overrides the sizing altogether (tests, tight RAM)."""

    block_size: int = 16
    memory_fraction: float | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def fraction_for(self, device: str) -> float:
        if self.memory_fraction is not None:
            return self.memory_fraction
        return 0.9 if device.startswith("cuda") else 0.2

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.memory_fraction is None or 0.0 < self.memory_fraction <= 1.0,
                 f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        _require(self.num_blocks is None or self.num_blocks > 0,
                 f"num_blocks must be positive, got {self.num_blocks}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass
class SchedulerConfig:
    """Continuous batching limits: a sequence cap and one token budget per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 before step N's tokens reach the host, so the host's
    # work (outputs, detokenization, scheduling, inputs) overlaps the device's; only a
    # device that runs asynchronously (CUDA) gains (Engine._step_async)
    async_scheduling: bool = False
    # "fcfs": arrival order; "priority": each request's `priority` first (lower sooner, vLLM's
    # rule), then arrival; preemption then takes the lowest priority's latest arrival
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES,
                 f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 "max_num_batched_tokens must be >= max_num_seqs "
                 f"({self.max_num_batched_tokens} < {self.max_num_seqs})")


# (max_num_seqs, max_num_batched_tokens) when not given. A CPU step of 64 rows is already
# compute-bound (docs/benchmarks.md); a GPU's decode step stays bound by its weight reads
# far beyond that, so throughput grows with the batch up to vLLM's defaults.
SCHEDULER_DEFAULTS = {"cpu": (64, 1024), "cuda": (256, 8192)}
# A server's token budget where it differs (with chunked prefill): every running stream
# waits for a step's prefill chunks, and a 1024-token step takes ~1.4 s on a 2-core CPU.
# 256-token chunks cut p99 inter-token latency at 32 clients from 1604 to 490 ms at the
# same output tok/s (docs/benchmarks.md, session 9).
SERVING_TOKEN_BUDGETS = {"cpu": 256}


def scheduler_defaults(device: str, max_num_seqs: int | None = None,
                       max_num_batched_tokens: int | None = None,
                       serving: bool = False) -> tuple[int, int]:
    """The given limits, the device's defaults for those left None (a server's budget with
    `serving`); a default token budget grows to hold a larger given max_num_seqs (every row
    of a decode step is a token)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    seqs, tokens = SCHEDULER_DEFAULTS[kind]
    if serving:
        tokens = SERVING_TOKEN_BUDGETS.get(kind, tokens)
    if max_num_seqs is not None:
        seqs = max_num_seqs
        if max_num_batched_tokens is None:
            tokens = max(tokens, seqs)
    return seqs, tokens if max_num_batched_tokens is None else max_num_batched_tokens


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: each decode step also verifies up to `num_speculative_tokens`
    proposed tokens in the same forward pass, keeping the longest prefix the model itself
    would have produced (so outputs follow the model's distribution exactly). "ngram"
    (prompt lookup) proposes what followed the last occurrence of the sequence's final
    n tokens, for n from `prompt_lookup_max` down to `prompt_lookup_min`: free to propose,
    and strong where outputs quote their input (editing, extraction, summaries, code).
    "draft_model" proposes the greedy continuation of a smaller model of the same
    vocabulary (`model`: a folder or GGUF, loaded like the target; `quantization` its
    weight format), which has its own KV cache in the target's blocks.
    0 tokens: off. `disable_by_batch_size`: no drafts while more sequences than this run
    or wait (verifying costs rows; once a step is compute-bound, as a CPU's is at a few rows, they
    cost more than accepted drafts give back; docs/benchmarks.md)."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    model: str | None = None          # the draft model ("draft_model")
    quantization: str | None = None   # the draft model's weights

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _require(0 <= self.num_speculative_tokens <= 32,
                 f"num_speculative_tokens must be in [0, 32], got {self.num_speculative_tokens}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _require(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
                 f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        drafting = self.method == "draft_model"
        _require(drafting == (self.model is not None),
                 "the draft_model method needs `model` (the draft's folder or GGUF)" if drafting
                 else f"`model` names a draft model: it needs method draft_model, not {self.method}")
        _require(self.quantization in QUANTIZATIONS,
                 f"speculative quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(drafting or self.quantization is None, "`quantization` applies to a draft model only")


# disable_by_batch_size when a speculative config does not say: a CPU step is compute-bound
# beyond a few rows, so verifying rows cost about what accepted drafts give back from 4
# sequences on (docs/benchmarks.md, session 11); a GPU's decode step stays bound by its
# weight reads far beyond that
SPECULATION_BATCH_LIMITS = {"cpu": 2, "cuda": None}


def speculative_config_from(value: SpeculativeConfig | dict | None, device: str = "cpu") -> SpeculativeConfig:
    """A SpeculativeConfig from vLLM's `speculative_config` dict ({"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    "disable_by_batch_size": 2}, or {"model": "path/to/draft", "num_speculative_tokens": 4}:
    a `model` without a method means "draft_model", as in vLLM); a given max alone also
    sets the min when that would exceed it; disable_by_batch_size left out takes the
    device's default (given as null: never disabled)."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a dict, got {type(value).__name__}")
    lookup = {"prompt_lookup_max", "prompt_lookup_min"}
    texts = {"method", "model", "quantization"}
    known = {"num_speculative_tokens", "disable_by_batch_size"} | lookup | texts
    unknown = sorted(set(value) - known)
    _require(not unknown, f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
    _require("num_speculative_tokens" in value, "speculative_config needs num_speculative_tokens")
    for key in known - texts:
        if value.get(key) is not None:
            _require(isinstance(value[key], int) and not isinstance(value[key], bool),
                     f"speculative_config {key} must be an integer, got {value[key]!r}")
    for key in texts:
        if value.get(key) is not None:
            _require(isinstance(value[key], str), f"speculative_config {key} must be a string, got {value[key]!r}")
    args = {key: item for key, item in value.items() if not (key == "method" and item is None)}
    _require(args.get("model") != "", "speculative_config model (the draft model) is empty")
    if args.get("model") is not None:
        args.setdefault("method", "draft_model")
        if args["method"] == "draft_model":
            given = sorted(lookup & set(args))
            _require(not given, f"{given} apply to the ngram method, not to a draft model")
    if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
        args["prompt_lookup_min"] = min(SpeculativeConfig.prompt_lookup_min, args["prompt_lookup_max"])
    if "disable_by_batch_size" not in args:
        args["disable_by_batch_size"] = SPECULATION_BATCH_LIMITS["cuda" if device.startswith("cuda") else "cpu"]
    return SpeculativeConfig(**args)


@dataclass
class ParallelConfig:
    """Tensor parallelism. With `tensor_parallel_size` > 1 the engine spawns the other ranks
    on this machine and rendezvous at `master_addr`:`master_port` (a free port if None).
    With `launched`, every rank was started from outside (torchrun, or one command per
    node) and this process is `rank`; all of them meet at `master_addr`:`master_port`.
    `local_rank` picks the GPU on this node. `timeout_s` bounds start-up and every
    collective: a rank that stops answering fails the engine instead of hanging it."""

    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    launched: bool = False
    rank: int = 0
    local_rank: int | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _require(self.master_port is None or 0 < self.master_port < 65536,
                 f"master_port must be in 1..65535, got {self.master_port}")
        _require(0 <= self.rank < self.tensor_parallel_size,
                 f"rank {self.rank} outside [0, {self.tensor_parallel_size})")
        _require(not self.launched or self.master_port is not None,
                 "ranks launched from outside need master_port (MASTER_PORT) to meet at")
        _require(self.timeout_s > 0, f"timeout_s must be positive, got {self.timeout_s}")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving. With `enable_lora`, every linear layer gets `max_loras` adapter
    slots of rank up to `max_lora_rank` (allocated before the KV cache is sized), and one
    step runs requests of up to `max_loras` distinct adapters (plus the base model).
    `lora_modules`: adapters loaded at start-up, name -> PEFT folder."""

    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        _require(not self.lora_modules or self.enable_lora, "lora_modules need enable_lora")


# the watermark test's default verdict line: the paper's, a false positive about once in
# 30,000 unmarked texts
DEFAULT_WATERMARK_Z_THRESHOLD = 4.0


@dataclass(frozen=True)
class WatermarkConfig:
    """The engine's watermark (tessera/sampling/watermark.py), for requests that ask for one:
    `gamma`, the vocabulary share that is green at each step; `delta`, the bias added to
    green logits; `key`, the secret that seeds the lists (deploy with your own: whoever
    knows it can detect the watermark, and scrub it). Defaults are TGI's
    (WATERMARK_GAMMA, WATERMARK_DELTA) and the paper's key, the millionth prime."""

    gamma: float = 0.5
    delta: float = 2.0
    key: int = 15485863

    def __post_init__(self) -> None:
        number = isinstance(self.gamma, (int, float)) and not isinstance(self.gamma, bool)
        _require(number and 0.0 < self.gamma < 1.0, f"watermark gamma must be in (0, 1), got {self.gamma!r}")
        number = isinstance(self.delta, (int, float)) and not isinstance(self.delta, bool)
        _require(number and 0.0 < self.delta < float("inf"),
                 f"watermark delta must be a finite number > 0, got {self.delta!r}")
        # keys are reduced mod 2**64 - 1 into a seed: a multiple of it would make every list one
        _require(isinstance(self.key, int) and not isinstance(self.key, bool) and 1 <= self.key < 2**64 - 1,
                 "watermark key must be an integer in [1, 2**64 - 1)")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "cpu"
    seed: int = 0
    # where returned logprobs come from: "raw" (the model's distribution, vLLM's default)
    # or "processed" (after penalties, temperature and filters, as TGI reports them)
    logprobs_mode: str = "raw"
    watermark: WatermarkConfig = field(default_factory=WatermarkConfig)

    def __post_init__(self) -> None:
        _require(self.device.split(":")[0] in ("cpu", "cuda"),
                 f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(self.logprobs_mode in ("raw", "processed"),
                 f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
