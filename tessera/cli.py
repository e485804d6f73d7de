"""`tessera generate | serve | bench | detect-watermark | models | inspect`. With
engine_args.py, the only place that reads environment variables."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tessera.config import DTYPES, KV_CACHE_DTYPES, MODEL_IMPLS, QUANTIZATIONS, scheduler_defaults
from tessera.engine_args import (add_engine_args, add_watermark_args, engine_config_from_args, image_limit,
                                 make_llm, serve_rank_if_not_driver)
from tessera.platform import resolve_device

# tessera/server/tool_parsers/'s PARSERS (not imported here: it would load the server)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "openai", "deepseek_v3", "deepseek_v31",
                     "qwen3_coder", "qwen3_xml", "gemma4")
# tessera/server/reasoning.py's REASONING_PARSERS (likewise)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss", "gemma4")
# tool-call parsers that read what a reasoning parser writes into the content: gpt-oss's
# calls are harmony messages, which only --reasoning-parser openai_gptoss turns into calls' text
TOOL_PARSER_NEEDS = {"openai": "openai_gptoss"}


def cmd_serve(args: argparse.Namespace) -> int:
    from tessera.server.serve import run_server
    from tessera.weights.source import resolve_model_source

    needed = TOOL_PARSER_NEEDS.get(args.tool_call_parser)
    if needed is not None and args.reasoning_parser != needed:
        raise SystemExit(f"--tool-call-parser {args.tool_call_parser} reads the calls --reasoning-parser "
                         f"{needed} writes into the answer: start the server with both")
    name = args.served_model_name or resolve_model_source(args.model).name
    api_key = args.api_key or os.environ.get("TESSERA_API_KEY")
    if args.lora_adapters is None:  # TGI's launcher variable, for the server only
        args.lora_adapters = os.environ.get("LORA_ADAPTERS")
    if not args.no_chunked_prefill:  # smaller prefill chunks: running streams wait less
        args.batch_size, args.max_num_batched_tokens = scheduler_defaults(
            args.device, args.batch_size, args.max_num_batched_tokens, serving=True)
    config = engine_config_from_args(args)
    if serve_rank_if_not_driver(config):  # rank > 0 of a multi-node group opens no port
        return 0
    return run_server(lambda: make_llm(args, config).engine,
                      model_name=name, host=args.host, port=args.port, api_key=api_key,
                      max_concurrent_requests=args.max_concurrent_requests,
                      max_input_tokens=args.max_input_tokens, tool_call_parser=args.tool_call_parser,
                      reasoning_parser=args.reasoning_parser,
                      allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                      payload_limit=args.payload_limit,
                      allowed_local_media_path=args.allowed_local_media_path,
                      max_images_per_prompt=args.limit_mm_per_prompt,
                      responses_store_size=args.responses_store_size,
                      prompt_tokens_details=args.enable_prompt_tokens_details)


def cmd_models(args: argparse.Namespace) -> int:
    from tessera.inspection import model_table

    rows = model_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = [("model_type", "MODEL TYPE"), ("model_class", "MODEL CLASS"), ("generates", "GENERATES"),
               ("supports_gguf", "GGUF"),
               ("supports_sliding_window", "SLIDING WINDOW"), ("is_moe", "MOE"),
               ("supports_tensor_parallel", "TENSOR PARALLEL"), ("supports_lora", "LORA"),
               ("supports_images", "IMAGES")]
    cells = [[h for _, h in columns]] + [
        [("yes" if r[k] else "no") if isinstance(r[k], bool) else str(r[k]) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\nAny other decoder-only type transformers implements runs on the transformers fallback "
          "(--model-impl auto|transformers): transformers' modeling code with tessera's paged "
          "attention, no GGUF. Types that do not generate (encoders) serve embeddings; any text "
          "type does with --runner pooling.")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from tessera.config import ModelConfig
    from tessera.inspection import format_report, inspect_model

    cache_dir = os.environ.get("TESSERA_CACHE_DIR")
    config = ModelConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                         max_model_len=args.max_model_len, model_impl=args.model_impl,
                         quantization=args.quantization, **({"cache_dir": Path(cache_dir)} if cache_dir else {}))
    info = inspect_model(config, device=args.device, block_size=args.block_size,
                         kv_cache_dtype=args.kv_cache_dtype, load=not args.no_weights)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="LLM inference and serving engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    from tessera.generate_cli import add_generate_parser
    add_generate_parser(sub, add_engine_args)

    from tessera.bench.cli import add_bench_parser, int_at_least, positive_int
    add_bench_parser(sub, add_engine_args)

    from tessera.watermark_cli import add_detect_parser
    add_detect_parser(sub, add_watermark_args)

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
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="give usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache "
                            "held) on /v1/chat/completions and /v1/completions, as vLLM's flag does; "
                            "/v1/responses and /v1/messages always report them")
    serve.add_argument("--responses-store-size", type=int_at_least(0), default=1000, metavar="N",
                       help="keep the last N finished /v1/responses in memory (unless a request sets store: "
                            "false), for previous_response_id and GET /v1/responses/{id}, and up to N "
                            "/v1/conversations; 0 keeps none")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="read tool calls in the model's own syntax, which enables tool_choice \"auto\" "
                            "(hermes: <tool_call>{...}</tool_call>, as Qwen 2.5/3 and Hermes models write; "
                            "llama3_json: a {\"name\", \"parameters\"} object, as Llama 3.1-3.3 write; "
                            "mistral: [TOOL_CALLS] and a JSON list or name[ARGS]{...}; pythonic: "
                            "[f(x=1), g()], as Llama 3.2 and 4 write; openai: gpt-oss's harmony calls, "
                            "with --reasoning-parser openai_gptoss; deepseek_v3 / deepseek_v31: DeepSeek's "
                            "<｜tool▁calls▁begin｜> blocks; qwen3_coder / qwen3_xml: <function=NAME><parameter=KEY>"
                            "..., as Qwen3-Coder and Qwen3.5 write, values typed by the tools' schemas; gemma4: "
                            "<|tool_call>call:NAME{...}<tool_call|>, as Gemma 4 writes)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split chat answers into reasoning_content (the <think>...</think> part) and "
                            "content: deepseek_r1 (DeepSeek-R1 and its distills, whose template opens "
                            "<think>), qwen3 (Qwen3, which writes <think> itself), openai_gptoss "
                            "(gpt-oss's harmony channels) or gemma4 (<|channel>thought ... <channel|>)")
    serve.add_argument("--payload-limit", type=positive_int, default=None, metavar="BYTES",
                       help="largest request body accepted (TGI's flag; default 2000000, or 50000000 "
                            "for a model that takes images, which come base64-encoded)")
    serve.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let requests name image files under DIR (file:// URLs or paths), as "
                            "vLLM's flag; without it only URLs and data URLs are read")
    serve.add_argument("--limit-mm-per-prompt", type=image_limit, default=8, metavar="JSON",
                       help="vLLM's flag: the most images one request may show, '{\"image\": N}' "
                            "(default 8); more is a 400 / 422 before any image is fetched")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read "
                            "folders on this machine: only for trusted clients)")
    add_engine_args(serve)
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
    insp.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS[1:],
                      help="show the builders chosen for int8 or int4 weight-only linear layers")
    insp.add_argument("--device", default="auto",
                      help="the device the ops are chosen for: auto (the GPU when torch sees one), cpu or cuda")
    insp.add_argument("--max-model-len", type=int, default=None)
    insp.add_argument("--block-size", type=int, default=16)
    insp.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                      help="show the attention builders chosen for this KV cache storage")
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
    if hasattr(args, "device"):  # "auto" made concrete once: defaults below depend on it
        launched = "WORLD_SIZE" in os.environ  # torchrun: each node's ranks on its own GPUs
        args.device = resolve_device(args.device, 1 if launched else getattr(args, "tensor_parallel_size", 1))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
