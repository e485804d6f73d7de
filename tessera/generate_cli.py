"""`tessera generate`: offline generation from the command line (its arguments, prompt
files, sampling and structured-output flags, and the printed or JSONL results)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_generate_parser(sub: argparse._SubParsersAction, add_engine_args) -> None:
    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("--input-file", help="text file (one prompt a line) or JSONL")
    gen.add_argument("--output-file", help="write JSONL results here instead of printing")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="default: the model's generation_config max_new_tokens, else 256")
    gen.add_argument("--ignore-eos", action="store_true")
    # unset sampling values come from the model's generation_config.json (--generation-config
    # auto, as LLM.generate does), else the FALLBACKS below
    gen.add_argument("--temperature", type=float, default=None,
                     help="0 = greedy (the default, unless the model's generation_config sets one)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--sample-seed", "--request-seed", type=int, default=None, dest="sample_seed",
                     help="per-request sampling seed (reproducible outputs)")
    gen.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the best's probability")
    gen.add_argument("--typical-p", type=float, default=1.0, help="locally typical sampling mass")
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="HF/TGI: divide (or multiply) the logits of prompt and output tokens")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI: minus this x count")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI: minus this if present")
    gen.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                     help="add BIAS (-100..100) to a token's logit (repeatable)")
    gen.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop before this text (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                     help="stop at this token id (repeatable)")
    gen.add_argument("--include-stop-str", action="store_true", help="keep the matched stop text")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--best-of", type=int, default=None, help="generate this many, keep the n best")
    gen.add_argument("--beam-search", action="store_true",
                     help="beam search over --best-of (else --n) beams; the --n best are printed, best first")
    gen.add_argument("--length-penalty", type=float, default=1.0,
                     help="beam search: a hypothesis scores its cumulative logprob / its length ** this")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="logprob of each token and its N best alternatives (in --output-file)")
    gen.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                     help="logprobs of the prompt tokens (in --output-file)")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument("--watermark", action="store_true",
                     help="watermark the output (the engine's --watermark-* settings; "
                          "`tessera detect-watermark` tests a text)")
    gen.add_argument("--image", action="append", default=[], metavar="PATH_OR_URL",
                     help="an image every prompt shows a multimodal model (repeatable): with --chat it "
                          "comes before the text; without, the prompt writes the model's placeholder "
                          "(e.g. <image>) where each goes")
    gen.add_argument("--lora", default=None, metavar="NAME",
                     help="run every prompt with this adapter (one of --lora-modules)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF grammar (start symbol root)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def _read_prompts(path: Path) -> list[str | list[dict]]:
    """A text file (one prompt a line) or JSONL: each line a string, {"prompt": ...}
    or {"messages": [...]} (chat)."""
    prompts: list[str | list[dict]] = []
    jsonl = path.suffix in (".jsonl", ".json")
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(line)
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not valid JSON ({exc.msg})")
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        else:
            raise SystemExit(f'{path}:{number}: expected a string, {{"prompt": ...}} or {{"messages": [...]}}')
    if not prompts:
        raise SystemExit(f"{path} holds no prompts")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from tessera.engine_args import engine_config_from_args, make_llm, serve_rank_if_not_driver

    prompts: list = list(args.prompts)
    if args.input_file:
        prompts += _read_prompts(Path(args.input_file))
    if not prompts:
        raise SystemExit("give a prompt, or --input-file FILE")
    params = _sampling_params(args)
    if args.stream and (len(prompts) != 1 or params.n != 1 or args.output_file):
        raise SystemExit("--stream prints one prompt's single completion as it is generated")
    config = engine_config_from_args(args)
    if serve_rank_if_not_driver(config):
        return 0
    with make_llm(args, config) as llm:
        # checked above with the fallbacks; now with the model's generation_config values too
        params = _sampling_params(args, llm.engine.router.sampling_defaults)
        return _generate(args, llm, prompts, params)


# what `tessera generate` samples with where neither the command line nor the model's
# generation_config.json says: greedy, 256 new tokens
FALLBACKS = {"max_new_tokens": 256, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
             "repetition_penalty": 1.0}


def _sampling_params(args: argparse.Namespace, model_defaults: dict | None = None):
    """The command line's sampling parameters; what it leaves unset comes from
    `model_defaults` (the router's generation_config values), else FALLBACKS."""
    from tessera.sampling.params import SamplingParams

    def given(name: str):
        value = getattr(args, name)
        return value if value is not None else (model_defaults or {}).get(name, FALLBACKS[name])

    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise SystemExit(f"--logit-bias expects TOKEN_ID=BIAS, got {item!r}")
    return SamplingParams(
        structured_outputs=_structured_outputs(args),
        max_new_tokens=given("max_new_tokens"), min_tokens=args.min_tokens, temperature=given("temperature"),
        top_k=given("top_k"), top_p=given("top_p"), min_p=given("min_p"), typical_p=args.typical_p,
        repetition_penalty=given("repetition_penalty"), frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, logit_bias=bias or None, seed=args.sample_seed,
        ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_id,
        include_stop_str_in_output=args.include_stop_str, n=args.n, best_of=args.best_of,
        logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs, watermark=args.watermark,
        use_beam_search=args.beam_search, length_penalty=args.length_penalty)


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """--json-schema FILE / --json-object / --regex / --choice ... / --grammar FILE."""
    if args.json_schema is not None:
        try:
            return {"json": json.loads(Path(args.json_schema).read_text())}
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--json-schema {args.json_schema}: {exc}")
    if args.grammar is not None:
        try:
            return {"grammar": Path(args.grammar).read_text()}
        except OSError as exc:
            raise SystemExit(f"--grammar {args.grammar}: {exc}")
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    return {"choice": args.choice} if args.choice else None


def _logprobs_json(positions) -> list | None:
    if positions is None:
        return None
    return [None if p is None else [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank,
                                     "text": lp.decoded_token} for t, lp in p.items()]
            for p in positions]


def _record(prompt, out) -> dict:
    """One JSONL line: the first completion's fields at the top (as before), every
    completion under "completions" when there are several."""
    def completion(c) -> dict:
        fields = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if c.cumulative_logprob is not None:
            fields["cumulative_logprob"] = c.cumulative_logprob
        if c.logprobs is not None:
            fields["logprobs"] = _logprobs_json(c.logprobs)
        return fields

    record = {"prompt": prompt, "prompt_token_ids": out.prompt_token_ids, **completion(out.outputs[0])}
    if len(out.outputs) > 1:
        record["completions"] = [dict(index=c.index, **completion(c)) for c in out.outputs]
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = _logprobs_json(out.prompt_logprobs)
    return record


def _engine_prompt(args: argparse.Namespace, llm, prompt: str | list[dict]):
    """What LLM.generate takes for one prompt of the command line or input file."""
    images = [{"type": "image_url", "image_url": {"url": image}} for image in args.image]
    if isinstance(prompt, list):
        if images:
            raise SystemExit("--image applies to prompts given as text; a JSONL chat names its images "
                             'in its messages ({"type": "image_url", "image_url": {"url": ...}})')
        return llm.chat_prompt(prompt)
    if args.chat:
        content = [*images, {"type": "text", "text": prompt}] if images else prompt
        return llm.chat_prompt([{"role": "user", "content": content}])
    return {"prompt": prompt, "multi_modal_data": {"image": list(args.image)}} if args.image else prompt


def _generate(args: argparse.Namespace, llm, prompts: list, params) -> int:
    token_prompts = [_engine_prompt(args, llm, p) for p in prompts]
    started = time.perf_counter()
    if args.stream:
        for _, out in llm.generate_stream(token_prompts, params, lora_request=args.lora):
            print(out.outputs[0].delta_text, end="", flush=True)
        print()
        outputs = [out]
    else:
        outputs = llm.generate(token_prompts, params, use_tqdm=len(prompts) > 1, lora_request=args.lora)
    elapsed = time.perf_counter() - started
    if args.output_file:
        with open(args.output_file, "w") as f:
            for prompt, out in zip(prompts, outputs):
                f.write(json.dumps(_record(prompt, out)) + "\n")
    elif args.stream:
        pass
    elif len(prompts) == 1 and params.n == 1:
        print(outputs[0].outputs[0].text)
    else:
        for prompt, out in zip(prompts, outputs):
            shown = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
            texts = [c.text if params.n == 1 else f"[{c.index}] {c.text}" for c in out.outputs]
            print(f"### {shown}\n" + "\n".join(texts) + "\n")
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"[{len(outputs)} prompts, {generated} tokens generated in {elapsed:.2f}s: "
          f"{generated / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0
