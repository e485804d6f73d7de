"""`tessera generate | serve | bench | models | inspect`. The only place that reads environment variables."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from tessera.config import DTYPES, LOAD_FORMATS, MODEL_IMPLS, scheduler_defaults

# tessera/server/tool_parsers.py's PARSERS (not imported here: it would load the server)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


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


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    p.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS,
                   help="native: a tessera model folder; transformers: transformers' modeling code with "
                        "tessera's paged attention; auto: native when a folder serves the type")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: bfloat16 on GPUs, on CPUs with native bf16 and on AVX512 / AVX2 CPUs "
                        "where tessera's kernels build; else float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None,
                   help="most sequences decoded together (max_num_seqs; default 64 on CPU, 256 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, prefill chunks + decodes (default 1024 on CPU, "
                        "256 for `serve` on CPU; 8192 on CUDA)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fix the KV cache size instead of sizing it from free memory")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="share of free memory for the KV cache (default 0.2 on CPU, 0.9 on CUDA)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse cached KV blocks of shared prompt prefixes")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt in one step (needs --max-num-batched-tokens >= max model length)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file overriding the tokenizer's")
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: seeded random weights for the model's config (benchmark real shapes "
                        "from a config.json alone; give --tokenizer if the folder has none)")
    p.add_argument("--quantization", "-q", default=None, choices=("int8",),
                   help="int8: linear weights quantized per output feature after loading "
                        "(half the weight memory; faster single-stream decode on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every decode step op by op instead of replaying captured graphs "
                        "(kernel graphs on CPU, CUDA graphs on GPU)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="launch each step before the last one's tokens reach the host, so scheduling "
                        "and output processing overlap the GPU (one rank; no gain on CPU, where a "
                        "step's outputs then come a step later)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4}\' '
                        '(drafts from n-grams of the sequence itself; the output is what the model alone '
                        'would give; no drafts while more than disable_by_batch_size sequences run or '
                        'wait: default 2 on CPU, none on CUDA)')
    p.add_argument("--speculate", type=int, default=None, metavar="N",
                   help="as TGI: speculative decoding with N n-gram draft tokens per step "
                        "(--speculative-config with its defaults)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (gloo on CPU, NCCL on CUDA)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="where the ranks meet (MASTER_ADDR when launched by torchrun)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: a free one; MASTER_PORT when launched by torchrun)")
    p.add_argument("--logprobs-mode", default="raw", choices=("raw", "processed"),
                   help="logprobs from the model's distribution (raw) or the one sampled from (processed)")


def _parallel_config(args: argparse.Namespace):
    """Spawned ranks by default; ranks launched per node when torchrun's variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are set."""
    from tessera.config import ParallelConfig

    tp, env = args.tensor_parallel_size, os.environ
    if tp > 1 and "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != tp:
            raise SystemExit(f"WORLD_SIZE={env['WORLD_SIZE']} but --tensor-parallel-size {tp}: "
                             "every rank of the group holds one shard, so they must match")
        port = env.get("MASTER_PORT") or args.master_port
        if port is None:
            raise SystemExit("launched ranks meet at MASTER_ADDR:MASTER_PORT; set MASTER_PORT or --master-port")
        return ParallelConfig(tp, master_addr=env.get("MASTER_ADDR", args.master_addr),
                              master_port=int(port), launched=True, rank=int(env["RANK"]),
                              local_rank=int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None)
    return ParallelConfig(tp, master_addr=args.master_addr, master_port=args.master_port)


def _engine_config(args: argparse.Namespace):
    from tessera.llm import engine_config

    cache_dir = os.environ.get("TESSERA_CACHE_DIR")
    return engine_config(args.model, dtype=args.dtype, tokenizer=args.tokenizer, max_model_len=args.max_model_len,
               max_num_seqs=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               enable_prefix_caching=not args.no_prefix_caching,
               enable_chunked_prefill=not args.no_chunked_prefill,
               memory_fraction=args.memory_fraction, device=args.device, seed=args.seed,
               chat_template=args.chat_template, cache_dir=cache_dir, logprobs_mode=args.logprobs_mode,
               model_impl=args.model_impl, load_format=args.load_format,
               quantization=args.quantization, enforce_eager=args.enforce_eager,
               async_scheduling=args.async_scheduling, speculative_config=_speculative_config(args),
               parallel=_parallel_config(args))


def _speculative_config(args: argparse.Namespace) -> dict | None:
    if args.speculative_config is not None and args.speculate is not None:
        raise SystemExit("give --speculative-config or --speculate, not both")
    if args.speculate is not None:
        return {"method": "ngram", "num_speculative_tokens": args.speculate}
    if args.speculative_config is None:
        return None
    try:
        value = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit("--speculative-config must be a JSON object")
    return value


def _serve_rank_if_not_driver(config) -> bool:
    """On a launched rank > 0: serve the driver's steps until it shuts down; True when done."""
    if not (config.parallel.launched and config.parallel.rank != 0):
        return False
    from tessera.distributed.worker import launched_rank_main

    logging.getLogger(__name__).info("rank %d of %d: following the driver at %s:%s",
                                     config.parallel.rank, config.parallel.tensor_parallel_size,
                                     config.parallel.master_addr, config.parallel.master_port)
    launched_rank_main(config)
    return True


def _make_llm(args: argparse.Namespace, config=None):
    from tessera.llm import LLM

    return LLM(config=config or _engine_config(args), show_progress=True)


def _sampling_params(args: argparse.Namespace):
    from tessera.sampling.params import SamplingParams

    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise SystemExit(f"--logit-bias expects TOKEN_ID=BIAS, got {item!r}")
    return SamplingParams(
        structured_outputs=_structured_outputs(args),
        max_new_tokens=args.max_new_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, typical_p=args.typical_p,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, logit_bias=bias or None, seed=args.sample_seed,
        ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_id,
        include_stop_str_in_output=args.include_stop_str, n=args.n, best_of=args.best_of,
        logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)


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

    record = {"prompt": prompt, **completion(out.outputs[0])}
    if len(out.outputs) > 1:
        record["completions"] = [dict(index=c.index, **completion(c)) for c in out.outputs]
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = _logprobs_json(out.prompt_logprobs)
    return record


def cmd_generate(args: argparse.Namespace) -> int:
    prompts: list = list(args.prompts)
    if args.input_file:
        prompts += _read_prompts(Path(args.input_file))
    if not prompts:
        raise SystemExit("give a prompt, or --input-file FILE")
    params = _sampling_params(args)
    if args.stream and (len(prompts) != 1 or params.n != 1 or args.output_file):
        raise SystemExit("--stream prints one prompt's single completion as it is generated")
    config = _engine_config(args)
    if _serve_rank_if_not_driver(config):
        return 0
    with _make_llm(args, config) as llm:
        return _generate(args, llm, prompts, params)


def _generate(args: argparse.Namespace, llm, prompts: list, params) -> int:
    token_prompts = [llm.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}])
                     if args.chat or isinstance(p, list) else p for p in prompts]
    started = time.perf_counter()
    if args.stream:
        for _, out in llm.generate_stream(token_prompts, params):
            print(out.outputs[0].delta_text, end="", flush=True)
        print()
        outputs = [out]
    else:
        outputs = llm.generate(token_prompts, params, use_tqdm=len(prompts) > 1)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from tessera.server.serve import run_server
    from tessera.weights.source import resolve_model_source

    name = args.served_model_name or resolve_model_source(args.model).name
    api_key = args.api_key or os.environ.get("TESSERA_API_KEY")
    if not args.no_chunked_prefill:  # smaller prefill chunks: running streams wait less
        args.batch_size, args.max_num_batched_tokens = scheduler_defaults(
            args.device, args.batch_size, args.max_num_batched_tokens, serving=True)
    config = _engine_config(args)
    if _serve_rank_if_not_driver(config):  # rank > 0 of a multi-node group opens no port
        return 0
    return run_server(lambda: _make_llm(args, config).engine,
                      model_name=name, host=args.host, port=args.port, api_key=api_key,
                      max_concurrent_requests=args.max_concurrent_requests,
                      max_input_tokens=args.max_input_tokens, tool_call_parser=args.tool_call_parser)


def cmd_models(args: argparse.Namespace) -> int:
    from tessera.inspection import model_table

    rows = model_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = [("model_type", "MODEL TYPE"), ("model_class", "MODEL CLASS"), ("supports_gguf", "GGUF"),
               ("supports_sliding_window", "SLIDING WINDOW"), ("is_moe", "MOE"),
               ("supports_tensor_parallel", "TENSOR PARALLEL")]
    cells = [[h for _, h in columns]] + [
        [("yes" if r[k] else "no") if isinstance(r[k], bool) else str(r[k]) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\nAny other decoder-only type transformers implements runs on the transformers fallback "
          "(--model-impl auto|transformers): transformers' modeling code with tessera's paged "
          "attention, no GGUF.")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from tessera.config import ModelConfig
    from tessera.inspection import format_report, inspect_model

    cache_dir = os.environ.get("TESSERA_CACHE_DIR")
    config = ModelConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                         max_model_len=args.max_model_len, model_impl=args.model_impl,
                         quantization=args.quantization, **({"cache_dir": Path(cache_dir)} if cache_dir else {}))
    info = inspect_model(config, device=args.device, block_size=args.block_size, load=not args.no_weights)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="LLM inference and serving engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("--input-file", help="text file (one prompt a line) or JSONL")
    gen.add_argument("--output-file", help="write JSONL results here instead of printing")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", "--request-seed", type=int, default=None, dest="sample_seed",
                     help="per-request sampling seed (reproducible outputs)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the best's probability")
    gen.add_argument("--typical-p", type=float, default=1.0, help="locally typical sampling mass")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
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
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="logprob of each token and its N best alternatives (in --output-file)")
    gen.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                     help="logprobs of the prompt tokens (in --output-file)")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF grammar (start symbol root)")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from tessera.bench.cli import add_bench_parser
    add_bench_parser(sub, _add_engine_args)

    serve = sub.add_parser("serve", help="serve the TGI and OpenAI APIs on one port")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health (or TESSERA_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    serve.add_argument("--max-concurrent-requests", type=int, default=128,
                       help="requests in flight beyond which clients get 429 'Model is overloaded'")
    serve.add_argument("--max-input-tokens", type=int, default=None,
                       help="longest prompt accepted (default: max model length - 1)")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="read tool calls in the model's own syntax, which enables tool_choice \"auto\" "
                            "(hermes: <tool_call>{...}</tool_call>, as Qwen 2.5/3 and Hermes models write; "
                            "llama3_json: a {\"name\", \"parameters\"} object, as Llama 3.1-3.3 write; "
                            "mistral: [TOOL_CALLS] and a JSON list or name[ARGS]{...}; pythonic: "
                            "[f(x=1), g()], as Llama 3.2 and 4 write)")
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list the native model types and what each supports (others run on the transformers fallback)")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=cmd_models)

    insp = sub.add_parser("inspect", help="show the router, model class and op choices for a model")
    insp.add_argument("--model", default=None,
                      help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    insp.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    insp.add_argument("--dtype", default="auto", choices=DTYPES)
    insp.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS,
                   help="native: a tessera model folder; transformers: transformers' modeling code with "
                        "tessera's paged attention; auto: native when a folder serves the type")
    insp.add_argument("--quantization", "-q", default=None, choices=("int8",),
                      help="show the builders chosen for int8 weight-only linear layers")
    insp.add_argument("--device", default="cpu", help="the device the ops are chosen for (cpu or cuda)")
    insp.add_argument("--max-model-len", type=int, default=None)
    insp.add_argument("--block-size", type=int, default=16)
    insp.add_argument("--no-weights", action="store_true", help="build the model but do not load weights")
    insp.add_argument("--json", action="store_true", help="machine-readable output")
    insp.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:  # per-request and per-plot INFO lines from libraries drown the results
        for noisy in ("httpx", "matplotlib"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
