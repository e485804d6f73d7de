"""TGI's request validation, in TGI's order and with TGI's messages
(router/src/validation.rs), producing token ids and SamplingParams."""
from __future__ import annotations

import secrets

from tessera.sampling.params import SamplingParams, SamplingParamsError
from tessera.server.errors import ValidationFailed
from tessera.server.protocol import GenerateParameters
from tessera.server.state import ServerState


def adapter_of(p: GenerateParameters, state: ServerState) -> str | None:
    """The LoRA adapter a request names in `adapter_id` (loaded with --lora-modules or
    /v1/load_lora_adapter); None, or the served model's name, is the base model."""
    if p.adapter_id is None or p.adapter_id == state.model_name:
        return None
    loaded = state.lora_names()
    if p.adapter_id not in loaded:
        raise ValidationFailed(f"`adapter_id` {p.adapter_id!r} is not a loaded adapter; loaded: {loaded}")
    return p.adapter_id


def validate_generate(inputs: str, p: GenerateParameters, state: ServerState,
                      stream: bool, ids: list[int] | None = None) -> tuple[list[int], SamplingParams]:
    """`ids`: the prompt's token ids when it is tokenized already (a prompt with images)."""
    lim = state.limits

    def fail(message: str) -> ValidationFailed:
        return ValidationFailed(message)

    best_of = p.best_of if p.best_of is not None else 1
    if best_of < 1 or best_of > lim.max_best_of:
        raise fail(f"`best_of` must be > 0 and <= {lim.max_best_of}. Given: {best_of}")
    if stream and best_of != 1:
        raise fail("`best_of` != 1 is not supported when streaming tokens")
    if stream and p.decoder_input_details:
        raise fail("`decoder_input_details` == true is not supported when streaming tokens")
    if p.temperature is not None and not p.temperature > 0:
        raise fail("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and not p.repetition_penalty > 0:
        raise fail("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise fail("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise fail("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise fail("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and not p.top_k > 0:
        raise fail("`top_k` must be strictly positive")
    if p.max_new_tokens is not None and not p.max_new_tokens > 0:
        raise fail("`max_new_tokens` must be strictly positive")
    if len(p.stop) > lim.max_stop_sequences:
        raise fail(f"`stop` supports up to {lim.max_stop_sequences} stop sequences. Given: {len(p.stop)}")
    top_n = p.top_n_tokens or 0
    if not 0 <= top_n <= lim.max_top_n_tokens:
        raise fail(f"`top_n_tokens` must be >= 0 and <= {lim.max_top_n_tokens}. Given: {top_n}")
    # TGI's router validates best_of against any warper given; its server samples only when
    # one changes the distribution (an explicit temperature 1.0 alone stays greedy)
    warpers_given = any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    sampling = p.do_sample or (p.temperature not in (None, 1.0)) or bool(p.top_k) \
        or p.top_p not in (None, 1.0) or p.typical_p not in (None, 1.0)
    if best_of > 1 and not (p.do_sample or warpers_given):
        raise fail("you must use sampling when `best_of` is > 1")
    if best_of > 1 and p.seed is not None:
        raise fail("`seed` must not be set when `best_of` > 1")
    if not inputs:
        raise fail("`inputs` cannot be empty")
    if p.truncate is not None and not 0 < p.truncate <= lim.max_input_tokens:
        raise fail(f"`truncate` must be strictly positive and less than {lim.max_input_tokens}. "  # TGI's words
                   f"Given: {p.truncate}")
    structured = grammar_constraint(p.grammar) if p.grammar is not None else None
    adapter_of(p, state)

    if ids is not None and p.truncate is not None and p.truncate < len(ids):
        raise fail("`truncate` cannot cut a prompt with images")
    ids = list(state.tokenizer(inputs).input_ids) if ids is None else ids
    if p.truncate is not None:
        ids = ids[-p.truncate:]
    n_in = len(ids)
    max_new = p.max_new_tokens if p.max_new_tokens is not None else max(lim.max_total_tokens - n_in, 1)
    if n_in + max_new > lim.max_total_tokens:
        raise fail(f"`inputs` tokens + `max_new_tokens` must be <= {lim.max_total_tokens}. "
                   f"Given: {n_in} `inputs` tokens and {max_new} `max_new_tokens`")
    if n_in > lim.max_input_tokens:
        raise fail(f"`inputs` must have less than {lim.max_input_tokens} tokens. Given: {n_in}")

    seed = p.seed
    if sampling and seed is None and best_of == 1:
        seed = secrets.randbits(63)  # TGI reports the seed it used, so pick one
    try:
        params = SamplingParams(
            max_new_tokens=max_new, do_sample=bool(sampling),
            temperature=p.temperature if p.temperature is not None else 1.0,
            top_k=p.top_k or 0, top_p=p.top_p if p.top_p is not None else 1.0,
            typical_p=p.typical_p if p.typical_p is not None else 1.0,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
            frequency_penalty=p.frequency_penalty or 0.0, seed=seed, stop=list(p.stop),
            include_stop_str_in_output=True,  # TGI's generated_text keeps the stop sequence
            n=best_of, best_of=best_of,
            logprobs=top_n,  # TGI reports every token's logprob (details and stream events)
            prompt_logprobs=0 if p.decoder_input_details else None,
            skip_special_tokens=True, structured_outputs=structured, watermark=p.watermark)
    except SamplingParamsError as exc:
        raise fail(str(exc)) from exc
    return ids, params


def grammar_constraint(grammar: dict, name: str = "grammar") -> dict:
    """TGI's GrammarType as structured outputs: {"type": "json", "value": schema} |
    {"type": "regex", "value": "..."} | {"type": "json_schema", "value": {"name"?, "schema"}}.
    `name`: the field it came in (TGI's `grammar`, or a chat `response_format`)."""
    kind, value = grammar.get("type"), grammar.get("value")
    if kind in ("json", "json_object") and isinstance(value, (dict, str)):  # TGI's alias; hub clients send it
        return {"json": value}
    if kind == "regex" and isinstance(value, str):
        return {"regex": value}
    if kind == "json_schema" and isinstance(value, dict) and isinstance(value.get("schema"), dict):
        return {"json": value["schema"]}
    raise ValidationFailed(f"`{name}` must be {{\"type\": \"json\", \"value\": <JSON schema>}}, "
                           "{\"type\": \"regex\", \"value\": <regex>} or "
                           "{\"type\": \"json_schema\", \"value\": {\"name\": ..., \"schema\": <JSON schema>}}",
                           param=None if name == "grammar" else name)
