"""What every route needs: the async engine, the tokenizer, the served name and the limits.
The HTTP server starts before the model has loaded (so /health can say 503 meanwhile);
`attach` completes the state once warm-up is done."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tessera.engine.detokenizer import TokenTexts, fast_decoder
from tessera.engine.stats import EngineStats
from tessera.pooling.config import PoolerConfig
from tessera.server.async_engine import AsyncEngine
from tessera.server.metrics import ServerMetrics
from tessera.server.reasoning import reasoning_tag_tokens
from tessera.server.conversations_store import ConversationStore
from tessera.server.responses_store import ResponseStore


@dataclass
class ServerLimits:
    """TGI launcher defaults, except the token limits, which come from the model."""

    max_input_tokens: int = 0
    max_total_tokens: int = 0
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    # bodies larger than this are refused before parsing, let alone tokenizing; None: TGI's
    # 2 MB, or 50 MB for a model that takes images (base64 images are large)
    max_body_bytes: int | None = None
    max_images_per_prompt: int = 8  # vLLM's --limit-mm-per-prompt '{"image": N}'


@dataclass
class ServerState:
    model_name: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    engine: AsyncEngine | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None  # "auto" tool choice reads the model's calls with it
    reasoning_parser: str | None = None  # chat answers split into reasoning_content and content
    allow_runtime_lora_updating: bool = False  # mount /v1/load_lora_adapter and unload
    ready: bool = False
    special_ids: frozenset[int] = frozenset()
    # per reasoning parser, its opening and end tags as tokens of the model (reasoning.py's
    # reasoning_tag_tokens), or None
    _reasoning_tokens: dict = field(default_factory=dict)
    # the model's generation_config.json sampling values: defaults of OpenAI requests
    sampling_defaults: dict = field(default_factory=dict)
    model_root: str | None = None  # what /v1/models gives as the base model's root: its --model
    # images: whether the model takes them, and where local image paths may be read from
    supports_images: bool = False
    image_placeholder: str | None = None  # what a prompt writes where an image goes
    allowed_local_media_path: Path | None = None
    pooling: bool = False  # an embedding model: /v1/embeddings and /embed, no generation
    pooler: PoolerConfig | None = None  # its pooling (`task`: embed, or classify: a cross-encoder)
    embedding_prompts: dict[str, str] = field(default_factory=dict)  # TEI's prompt_name -> text
    # what pooling inputs pass to enter the engine: never more than the in-flight limit at once
    pooling_gate: asyncio.Semaphore | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept for later turns
    conversations: ConversationStore = field(default_factory=ConversationStore)  # /v1/conversations
    prompt_tokens_details: bool = False  # OpenAI usage's cached_tokens on chat and completions (vLLM's flag)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self._stats)
        self._token_text: dict[int, str] = {}

    def _stats(self) -> EngineStats:
        if self.engine is None:
            return EngineStats(0, 0, 0.0, 0, 0, 0, 0)
        return self.engine.engine.stats()

    def reasoning_tokens(self, parser: str) -> tuple[int | None, int | None]:
        """Reasoning parser `parser`'s (opening, end) tag tokens in this model (None where a
        tag is not one token kept in the text, or past the model's vocabulary)."""
        if parser not in self._reasoning_tokens:
            vocab = self.engine.engine.router.config.vocab_size
            tags = reasoning_tag_tokens(self.tokenizer, parser)
            self._reasoning_tokens[parser] = tuple(t if t is not None and t < vocab else None for t in tags)
        return self._reasoning_tokens[parser]

    def attach(self, engine: AsyncEngine) -> None:
        """The model is loaded and warm: start answering requests."""
        core = engine.engine
        self.engine = engine
        self.tokenizer = core.tokenizer
        self.chat_template = core.router.chat_template
        self.special_ids = frozenset(core.tokenizer.all_special_ids)
        self.decode = fast_decoder(core.tokenizer)
        self.sampling_defaults = core.router.sampling_defaults  # generation_config.json's
        self.model_root = core.config.model.model or str(core.router.source.path)
        self._reasoning_tokens.clear()
        self.limits.max_total_tokens = core.max_model_len
        room = 0 if core.is_pooling else 1  # a prompt to pool may fill the context
        if not self.limits.max_input_tokens or self.limits.max_input_tokens > core.max_model_len - room:
            self.limits.max_input_tokens = core.max_model_len - room
        self.limits.max_concurrent_requests = engine.max_concurrent_requests
        self.supports_images = core.supports_images
        self.image_placeholder = core.image_placeholder
        self.pooling = core.is_pooling
        self.pooler = core.pooler_config
        self.embedding_prompts = core.pooler_config.prompts if core.is_pooling else {}
        self.pooling_gate = asyncio.Semaphore(engine.max_concurrent_requests)
        if self.limits.max_body_bytes is None:
            self.limits.max_body_bytes = 50_000_000 if self.supports_images else 2_000_000
        self.ready = True

    @property
    def pipeline_tag(self) -> str:
        """The Hugging Face task of what this server serves (TGI's /info model_pipeline_tag)."""
        if self.pooling:
            return "text-classification" if self.pooler.task == "classify" else "feature-extraction"
        return "image-text-to-text" if self.supports_images else "text-generation"

    def lora_names(self) -> list[str]:
        """The loaded LoRA adapters' names (clients pass one as `model` or `adapter_id`)."""
        return [adapter.name for adapter in self.engine.engine.list_loras()]

    def token_texts(self, prompt_ids: list[int]) -> TokenTexts:
        """Per-token texts of an output as TGI streams them (multi-byte characters whole)."""
        return TokenTexts(self.decode, prompt_ids)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (as TGI reports it), cached: the vocabulary is fixed."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text
