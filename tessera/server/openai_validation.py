"""An OpenAI request body as the engine's inputs: the model (or LoRA adapter) it names, its
SamplingParams with its one output constraint and its length, each refused
with vLLM's message and the field it came in (`param`)."""
from __future__ import annotations

from typing import Callable

from tessera.sampling.params import SamplingParams, SamplingParamsError
from tessera.server.errors import ModelNotFound, ValidationFailed
from tessera.engine.outputs import RequestOutput
from tessera.server.protocol import _OpenAISampling, wire_logprob
from tessera.server.state import ServerState
from tessera.server.tgi_validation import grammar_constraint
from tessera.server.tool_calls import ToolPlan


# what TGI's clients send as `model` when given only a URL (text_generation: "tgi",
# huggingface_hub: "dummy"); TGI ignores the field, so these mean the served model
CLIENT_PLACEHOLDER_MODELS = ("tgi", "dummy")
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: alternatives per token a request may ask for


def wire_prompt_logprobs(out: RequestOutput, token_text: Callable[[int], str]) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), its own and the top
    alternatives, keyed by token id."""
    if out.prompt_logprobs is None:
        return None
    return [None if lp is None else {str(t): {"logprob": wire_logprob(v.logprob), "rank": v.rank,
                                              "decoded_token": token_text(t)} for t, v in lp.items()}
            for lp in out.prompt_logprobs]


def resolve_model(state: ServerState, name: str | None) -> tuple[str, str | None]:
    """(the name responses carry, the LoRA adapter to run with) for a request's `model`:
    the served model (or none given) runs the base model, a loaded adapter's name runs it."""
    if name is None or name == state.model_name:
        return state.model_name, None
    if name in state.lora_names():
        return name, name
    if name in CLIENT_PLACEHOLDER_MODELS:
        return state.model_name, None
    served = ", ".join(f"`{n}`" for n in [state.model_name, *state.lora_names()])
    raise ModelNotFound(f"The model `{name}` does not exist. This server serves {served}.", param="model")


def structured_outputs(body: _OpenAISampling) -> dict | None:
    """The one output constraint a request gives: vLLM's `structured_outputs` or a
    `guided_*` field, or (chat) OpenAI's `response_format`."""
    given: list[tuple[str, dict]] = []
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            given.append((f"guided_{kind}", {kind: value}))
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        if response_format.type in ("json", "regex") or (response_format.type == "json_object" and (
                response_format.value is not None)) or (
                response_format.type == "json_schema" and response_format.json_schema is None):
            # TGI's grammar shape; huggingface_hub sends a json_schema as {"type": "json_object", "value": schema}
            given.append(("response_format", grammar_constraint(
                {"type": response_format.type, "value": response_format.value}, "response_format")))
        elif response_format.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            spec = response_format.json_schema
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValidationFailed("`response_format` of type 'json_schema' needs `json_schema` with "
                                       "a `schema` object", param="response_format")
            given.append(("response_format", {"json": spec["schema"]} if "schema" in spec
                          else {"json_object": True}))
    if len(given) > 1:
        raise ValidationFailed(f"give one output constraint, not {' and '.join(n for n, _ in given)}",
                               param=given[1][0])
    return given[0][1] if given else None


def sampling_params(body: _OpenAISampling, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, best_of: int | None = None,
                    tools: ToolPlan | None = None, defaults: dict | None = None) -> SamplingParams:
    """`prompt_logprobs`: what the route needs (echo); vLLM's own field adds to it.
    `defaults`: the model's generation_config sampling values, for fields the body leaves out."""
    defaults = defaults or {}

    def given(name: str, neutral):
        value = getattr(body, name)
        return value if value is not None else defaults.get(name, neutral)

    if body.stream_options is not None and not body.stream:
        raise ValidationFailed("`stream_options` is only for `stream: true`", param="stream_options")
    if body.prompt_logprobs is not None:
        if body.stream:
            raise ValidationFailed("`prompt_logprobs` is returned by non-streaming requests only",
                                   param="prompt_logprobs")
        if not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
            raise ValidationFailed(f"`prompt_logprobs` must be in [0, {MAX_LOGPROBS}]", param="prompt_logprobs")
        prompt_logprobs = max(prompt_logprobs or 0, body.prompt_logprobs)
    structured = structured_outputs(body)
    if tools is not None and tools.constraint is not None:
        if structured is not None:
            raise ValidationFailed("give one output constraint: a `tool_choice` that calls tools "
                                   "already constrains the output", param="tool_choice")
        structured = tools.constraint
    try:
        return SamplingParams(
            structured_outputs=structured,
            max_tokens=max_tokens, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=given("top_k", 0) or 0, min_p=given("min_p", 0.0) or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0) or 1.0,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
            logit_bias=body.logit_bias, seed=body.seed, n=body.n, best_of=best_of,
            stop=body.stop, stop_token_ids=body.stop_token_ids or [], min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
            # a tool-call parser reads tags that some tokenizers mark special (as vLLM does)
            skip_special_tokens=body.skip_special_tokens and (tools is None or tools.parser is None),
            logprobs=logprobs, watermark=body.watermark,
            allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
            prompt_logprobs=prompt_logprobs, use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty, early_stopping=body.early_stopping)
    except SamplingParamsError as exc:
        raise ValidationFailed(str(exc)) from exc


def output_limit(state: ServerState, requested: int | None, n_prompt: int) -> int:
    """The max_tokens of a request for a prompt of `n_prompt` tokens, as vLLM sets it: the
    least of what it asked for, the model's generation_config max_new_tokens and the
    context's room; asking for more room than there is fails (check_length)."""
    limit = state.limits.max_total_tokens
    if requested is None and n_prompt >= limit:  # nothing asked for: the prompt alone is too long
        raise ValidationFailed(f"This model's maximum context length is {limit} tokens. However, your "
                               f"prompt has {n_prompt} tokens, leaving no room to generate. Please reduce "
                               "the length of the prompt.")
    room = max(limit - n_prompt, 1)
    check_length(state, n_prompt, requested if requested is not None else room)
    capped = capped_max_tokens(state, requested)
    return room if capped is None else min(capped, room)


def capped_max_tokens(state: ServerState, requested: int | None) -> int | None:
    """`requested` capped by the model's generation_config max_new_tokens (either may be
    None; None: until the context ends)."""
    cap = state.sampling_defaults.get("max_new_tokens")
    return min((v for v in (requested, cap) if v is not None), default=None)


def check_length(state: ServerState, n_prompt: int, max_tokens: int) -> None:
    limit = state.limits.max_total_tokens
    if n_prompt + max_tokens > limit:
        raise ValidationFailed(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.", param="max_tokens")
