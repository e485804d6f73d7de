"""Request bodies of the TGI and OpenAI routes (response bodies are built as plain dicts,
in the exact shapes of ../shared/API.md)."""
from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A logprob of -inf (a token the processed distribution excludes) is not JSON; vLLM's API
# sends this floor instead.
LOGPROB_FLOOR = -9999.0


def wire_logprob(logprob: float | None) -> float | None:
    return logprob if logprob is None or logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation) or annotation is Any


class GenerateParameters(BaseModel):
    """TGI's 19 parameters. Every field defaults as TGI's code does (not its OpenAPI doc)."""

    model_config = ConfigDict(extra="ignore")  # as TGI's serde: unknown keys are ignored

    adapter_id: str | None = None
    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: dict[str, Any] | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)  # TGI's seed is a u64
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False


def default_parameters() -> GenerateParameters:
    """What TGI uses when a request has no `parameters` object at all."""
    return GenerateParameters(do_sample=True, details=False)


class GenerateRequest(BaseModel):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=default_parameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class TokenizeRequest(BaseModel):
    inputs: str
    parameters: GenerateParameters | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _NullIsTheDefault(BaseModel):
    """An explicit null means the field's default, as in OpenAI's and vLLM's (Optional)
    fields: TGI's text_generation client sends every unset field as null."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or _accepts_none(cls.model_fields[k].annotation)}


class _OpenAISampling(_NullIsTheDefault):
    """Fields common to /v1/completions and /v1/chat/completions (plus vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's: lower is scheduled sooner (--scheduling-policy priority)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: all that fit)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # vLLM's: alternatives per prompt token (non-streaming replies)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    # TGI's and MindIE's green-list watermark, on the OpenAI routes too (a tessera extra)
    watermark: bool = False
    # vLLM's beam search: n beams (best_of on /v1/completions), returned best first; the
    # sampling warpers (temperature, top_p, top_k, min_p) do not apply to it
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # vLLM's structured outputs: one of json / regex / choice / grammar / json_object, and
    # its older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's (json_object / json_schema), on /v1/completions too as vLLM takes it
    response_format: ResponseFormat | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ... pass to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class VllmTokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API request (responses_input.py: what it takes, what it refuses)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    prompt: Any = None
    conversation: Any = None
    # taken and ignored: hints for OpenAI's service that change nothing here
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


class ResponseFormat(BaseModel):
    """OpenAI's (text / json_object / json_schema with `json_schema`), or TGI's grammar
    shape (json / regex / json_schema with `value`), which TGI's clients send."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: dict[str, Any] | None = None
    value: Any = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message left open, continued
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; reaches the chat template as `reasoning_effort` (gpt-oss's sets its
    # "Reasoning: low | medium | high" line from it); templates without it ignore it
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: the most tokens the reasoning may take before its end tag is forced (needs a
    # reasoning parser whose tags are tokens of the model)
    thinking_token_budget: int | None = Field(default=None, ge=0)


# a text, texts, token ids, or lists of token ids (OpenAI's embeddings `input`, TEI's `inputs`)
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_NullIsTheDefault):
    """OpenAI's /v1/embeddings body, with vLLM's extras: `messages` instead of `input` embeds a
    conversation rendered by the chat template (vLLM's chat embedding request)."""

    model: str | None = None
    input: EmbeddingInput | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # default: True for `input`, False for `messages`
    normalize: bool | None = None
    priority: int = 0
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _input_or_messages(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError("give `input` or `messages` (a conversation), not both and not neither")
        return self


class EmbedRequest(BaseModel):
    """Text Embeddings Inference's /embed body (TGI's sibling server for embeddings)."""

    inputs: EmbeddingInput
    normalize: bool = True
    truncate: bool | None = False
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    prompt_name: str | None = None
    dimensions: int | None = None


class ScoreRequest(_NullIsTheDefault):
    """vLLM's /score: text_1 scored against each text_2 (or pairwise, lists of one length)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Cohere's documents may carry more fields

    text: str


class RerankRequest(_NullIsTheDefault):
    """vLLM's /rerank (Jina's and Cohere's shape: `documents`)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class TEIRerankRequest(BaseModel):
    """Text Embeddings Inference's /rerank (`texts`)."""

    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = False
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"


class ClassifyRequest(_NullIsTheDefault):
    """vLLM's /classify."""

    model: str | None = None
    input: EmbeddingInput
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0


class PredictRequest(BaseModel):
    """Text Embeddings Inference's /predict: a text, a pair [a, b], or a batch of either."""

    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = False
    truncate: bool | None = False
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
