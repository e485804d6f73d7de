"""`tessera bench throughput | latency | prefix | chunked | speculative | lora | kv-cache | images`: tessera
beside transformers' `generate` or a feature on and off, one process; `tessera bench serve`: a
running server over HTTP."""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
from pathlib import Path

import torch

from tessera.bench.presets import PRESETS
from tessera.bench.report import markdown_table, plot_latency_sweep, write_json
from tessera.bench.workload import DatasetEntry, Workload, read_dataset


def int_at_least(least: int):
    """An argparse type: an integer >= `least` (a size, a count), refused before any model loads."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1 (a sweep of batch sizes)."""
    return [positive_int(part) for part in text.split(",")]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_bench_parser(sub: argparse._SubParsersAction, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="measure throughput or latency (optionally beside transformers)")
    bench.add_argument("workload", choices=("throughput", "latency", "prefix", "chunked", "speculative", "lora",
                                            "kv-cache", "images", "embed", "serve"),
                       help="throughput/latency: beside --baseline; prefix: TTFT of a request "
                            "sharing a long prefix, caching on vs off; chunked: decode ITL while a "
                            "long prompt arrives, chunked prefill on vs off; speculative: n-gram "
                            "speculative decoding on vs off (--speculate N, default 4; or a draft model: "
                            "--speculative-config '{\"model\": PATH, \"num_speculative_tokens\": 4}') on chat prompts "
                            "that quote a passage and ones that do not, per --batch-sizes; lora: the "
                            "base model vs one adapter vs --max-loras adapters in each batch, per "
                            "--batch-sizes (random adapters of rank --max-lora-rank); kv-cache: the "
                            "model-dtype KV cache vs --kv-cache-dtype (default fp8): bytes per token, "
                            "prefill and decode speed per --batch-sizes, logprob drift; images: what an "
                            "image of each --image-sizes costs a prompt (encoder time, TTFT, TPOT) beside "
                            "a text prompt as long (a model that takes images; --preset qwen2.5-vl-3b or gemma-3-4b); embed: "
                            "embedding throughput of --num-prompts prompts (runs the model with --runner "
                            "pooling; beside --baseline transformers' padded batches; --preset "
                            "qwen3-embedding-0.6b); serve: "
                            "TTFT, TPOT, ITL and throughput of a running server (--url)")
    bench.add_argument("--num-prompts", type=positive_int, default=32, help="throughput/serve: prompts in the run")
    bench.add_argument("--batch-sizes", type=positive_ints, default=[1], help="latency: comma-separated batch sizes")
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--repeats", type=positive_int, default=3, help="runs per measurement; the median is reported")
    bench.add_argument("--image-sizes", type=positive_ints, default=[448],
                       help="images: comma-separated sides of square images, in pixels")
    bench.add_argument("--embed-batch-size", type=positive_int, default=32,
                       help="embed: the transformers baseline's padded batch (sentence-transformers' default)")
    bench.add_argument("--prefix-len", type=int, default=1024, help="prefix: shared prefix tokens")
    bench.add_argument("--num-decodes", type=int, default=4, help="chunked: running decode requests")
    bench.add_argument("--long-prompt-len", type=int, default=2048, help="chunked: arriving prompt")
    bench.add_argument("--chunk-tokens", type=int, default=256, help="chunked: step token budget")
    bench.add_argument("--baseline", choices=("transformers",), default=None)
    bench.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help="benchmark a published model's shapes with random weights (its config.json "
                            "is written locally; implies --load-format dummy; nothing is downloaded)")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    bench.add_argument("--output-json", default=None)
    bench.add_argument("--dataset", default=None,
                       help="throughput/serve: JSONL file of {\"prompt\": ...} lines instead of random "
                            "prompts; throughput takes the first --num-prompts (the file must have that "
                            "many) and a line's optional \"output_len\" overrides --output-len; serve "
                            "cycles the file and sends --output-len")
    bench.add_argument("--plot", default=None,
                       help="PNG of a sweep: latency (several --batch-sizes): TPOT and TTFT vs batch size "
                            "per engine; serve (several --concurrency): output tok/s and p99 ITL vs concurrency")
    serve = bench.add_argument_group("serve", "the serving benchmark; start `tessera serve` (or any "
                                     "TGI/OpenAI server) first. --seed seeds prompts and arrivals; "
                                     "--model names the OpenAI model (default: its /v1/models)")
    serve.add_argument("--url", default=None, help="the running server, e.g. http://127.0.0.1:8080")
    serve.add_argument("--backend", choices=("tgi", "openai", "openai-chat"), default="openai",
                       help="tgi: /generate_stream; openai: /v1/completions; openai-chat: /v1/chat/completions")
    serve.add_argument("--concurrency", default=None,
                       help="most requests in flight; comma-separated for a sweep (1,4,16,32); default: no cap")
    serve.add_argument("--request-rate", type=positive_float, default=float("inf"),
                       help="Poisson arrivals, requests/s (default inf: all at once)")
    serve.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="skip the one untimed request sent before the first level")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)


def _scenario(args: argparse.Namespace, engine) -> int:
    from tessera.bench.scenarios import chunked_itl, prefix_ttft

    if args.workload == "prefix":
        rows = prefix_ttft(engine, args.prefix_len, args.input_len, args.repeats)
        columns = ["engine", "ttft_ms", "prefix_len", "suffix_len"]
        higher = False
    else:
        rows = chunked_itl(engine, args.num_decodes, args.long_prompt_len, args.chunk_tokens)
        columns = ["engine", "max_itl_ms", "p50_itl_ms", "long_prompt_ttft_ms", "num_decodes"]
        higher = False
    meta = {"workload": args.workload, "model": engine.router.source.name, "dtype": str(engine.dtype),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(f"\n{args.workload}: {meta['model']} {meta['dtype']}, {meta['threads']} threads")
    print(markdown_table(rows, columns, rows[1].engine, higher_is_better=higher))
    if args.output_json:
        write_json(Path(args.output_json), meta, rows)
    return 0


def _speculative(args: argparse.Namespace, engine) -> int:
    from tessera.bench.speculative import speculative_bench

    sizes = args.batch_sizes
    rows = speculative_bench(engine, sizes, args.output_len, args.repeats)
    meta = {"workload": "speculative", "model": engine.router.source.name, "dtype": str(engine.dtype),
            "threads": torch.get_num_threads(), "output_len": args.output_len, "repeats": args.repeats,
            "speculative": dataclasses.asdict(engine.config.speculative), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine()}
    print(f"\nspeculative: {meta['model']} {meta['dtype']}, {meta['threads']} threads, greedy, up to "
          f"{args.output_len} tokens, median of {args.repeats}")
    print(markdown_table(rows, ["engine", "ms_per_token", "workload", "batch_size", "output_tokens_per_s",
                                "tokens_per_step", "acceptance_rate", "same_as_plain"]))
    if args.output_json:
        write_json(Path(args.output_json), meta, rows)
    return 0


def _lora(args: argparse.Namespace, engine) -> int:
    from tessera.bench.lora import lora_bench

    sizes = args.batch_sizes
    rows = lora_bench(engine, sizes, args.input_len, args.output_len, args.repeats)
    lora = engine.config.lora
    meta = {"workload": "lora", "model": engine.router.source.name, "dtype": str(engine.dtype),
            "threads": torch.get_num_threads(), "input_len": args.input_len, "output_len": args.output_len,
            "repeats": args.repeats, "max_loras": lora.max_loras, "rank": lora.max_lora_rank,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    print(f"\nlora: {meta['model']} {meta['dtype']}, {meta['threads']} threads, rank {lora.max_lora_rank} "
          f"on every projection, {args.input_len} in / {args.output_len} out, median of {args.repeats}")
    print(markdown_table(rows, ["engine", "output_tokens_per_s", "batch_size", "ms_per_token"], "tessera, base model"))
    if args.output_json:
        write_json(Path(args.output_json), meta, rows)
    return 0


def _images(args: argparse.Namespace, engine) -> int:
    from tessera.bench.images import images_bench

    rows = images_bench(engine, args.image_sizes, args.input_len, args.output_len, args.repeats)
    meta = {"workload": "images", "model": engine.router.source.name, "dtype": str(engine.dtype),
            "threads": torch.get_num_threads(), "text_len": args.input_len, "output_len": args.output_len,
            "repeats": args.repeats, "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    print(f"\nimages: {meta['model']} {meta['dtype']}, {meta['threads']} threads, about {args.input_len} text "
          f"tokens beside each image, {args.output_len} out, median of {args.repeats}")
    print(markdown_table(rows, ["engine", "ttft_ms", "prompt_tokens", "image_tokens", "encode_ms", "tpot_ms"]))
    if args.output_json:
        write_json(Path(args.output_json), meta, rows)
    return 0


def _kv_cache(args: argparse.Namespace) -> int:
    """One engine per cache: it cannot share the process's usual single LLM."""
    from tessera.bench.kv_cache import kv_cache_bench
    from tessera.engine_args import make_llm

    quantized = "fp8" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    sizes = args.batch_sizes
    speed, summary = kv_cache_bench(lambda kv: make_llm(argparse.Namespace(**{**vars(args), "kv_cache_dtype": kv})),
                                    ["auto", quantized], sizes, args.input_len, args.output_len, args.repeats)
    meta = {"workload": "kv-cache", "model": args.model or "default", "dtype": args.dtype,
            "threads": torch.get_num_threads(), "input_len": args.input_len, "output_len": args.output_len,
            "repeats": args.repeats, "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    print(f"\nkv-cache: {meta['model']}, {meta['threads']} threads, {args.input_len} in / "
          f"{args.output_len} out, median of {args.repeats}")
    print(markdown_table(summary, ["engine", "kv_dtype", "kv_bytes_per_token", "cache_tokens", "cache_capped",
                                   "nll", "mean_abs_logprob_change"]))
    print()
    print(markdown_table(speed, ["engine", "decode_tokens_per_s", "batch_size", "prefill_tokens_per_s"],
                         "tessera, kv auto"))
    if args.output_json:
        write_json(Path(args.output_json), meta, [*summary, *speed])
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tessera.engine_args import make_llm

    if args.workload == "serve":  # measures a server over HTTP: no engine in this process
        from tessera.bench.serve import run_serve_bench
        return run_serve_bench(args)
    if args.dataset and args.workload not in ("throughput", "embed"):
        raise SystemExit("--dataset applies to the throughput, embed and serve workloads")
    entries = _dataset(args) if args.dataset else None  # a bad file fails before the model loads
    if args.preset:
        if args.model:
            raise SystemExit("--preset names the model; drop --model")
        from tessera.bench.presets import write_preset
        from tessera.config import ModelConfig
        cache = os.environ.get("TESSERA_CACHE_DIR")
        args.model = str(write_preset(args.preset, Path(cache) if cache else ModelConfig().cache_dir))
        args.load_format = "dummy"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.workload == "speculative" and args.speculate is None and args.speculative_config is None:
        args.speculate = 4
    if args.workload == "lora":
        args.enable_lora = True
    if args.workload == "kv-cache":
        return _kv_cache(args)
    if args.workload == "embed":
        args.runner = "pooling"
    with make_llm(args) as llm:
        return _bench(args, llm, entries)


def _dataset(args: argparse.Namespace) -> list[DatasetEntry]:
    """The first --num-prompts lines of --dataset; fewer is an error (no cycling)."""
    entries = read_dataset(Path(args.dataset))
    if len(entries) < args.num_prompts:
        raise SystemExit(f"--dataset {args.dataset} has {len(entries)} prompts, fewer than "
                         f"--num-prompts {args.num_prompts}")
    return entries[:args.num_prompts]


def _requests(args: argparse.Namespace, engine, num: int,
              entries: list[DatasetEntry] | None) -> tuple[list[list[int]], list[int]]:
    """The prompts (token ids) and output lengths of the run: the dataset's, tokenized by the
    engine, or `num` random prompts of --input-len tokens."""
    if entries is None:
        prompts = Workload(num, args.input_len, args.output_len).prompts(engine.router.config.vocab_size,
                                                                         engine.router.eos_token_ids)
        return prompts, [args.output_len] * num
    return [engine.encode(e.prompt) for e in entries], [e.output_len or args.output_len for e in entries]


def _bench(args: argparse.Namespace, llm, entries: list[DatasetEntry] | None) -> int:
    from tessera.bench.offline import tessera_latency, tessera_throughput

    engine = llm.engine
    if args.workload in ("prefix", "chunked"):
        return _scenario(args, engine)
    if args.workload == "speculative":
        return _speculative(args, engine)
    if args.workload == "lora":
        return _lora(args, engine)
    if args.workload == "images":
        return _images(args, engine)
    if args.workload == "embed":
        return _embed(args, llm, entries)
    sizes = args.batch_sizes if args.workload == "latency" else [args.num_prompts]
    prompts, output_lens = _requests(args, engine, max(sizes), entries)
    rows: list[object] = []
    model = None
    roofline = None
    if args.workload == "latency":
        from tessera.bench.roofline import engine_roofline
        roofline = engine_roofline(engine)
    if args.baseline == "transformers":
        from tessera.bench.transformers_baseline import load_transformers_model
        model = load_transformers_model(engine.router.source, engine.dtype,
                                        dummy=engine.config.model.load_format == "dummy",
                                        device=engine.runner.device)
    for size in sizes:
        w = Workload(size, args.input_len, args.output_len)
        if args.workload == "throughput":
            rows.append(tessera_throughput(llm, prompts, output_lens, args.repeats))
        else:
            rows.append(tessera_latency(llm, w, prompts[:size], args.repeats))
        if model is not None:
            from tessera.bench.transformers_baseline import transformers_latency, transformers_throughput
            rows.append(transformers_throughput(model, prompts, output_lens, args.repeats)
                        if args.workload == "throughput" else transformers_latency(model, w, prompts[:size],
                                                                                   args.repeats))
    if roofline is not None:
        for row in rows:  # decode steps attend to input_len + 1 .. input_len + output_len - 1 tokens
            row.roofline_ms = roofline.step_ms(row.batch_size, args.input_len + args.output_len / 2)
            row.roofline_pct = 100 * row.roofline_ms / row.tpot_ms
    columns = (["engine", "output_tokens_per_s", "elapsed_s", "requests_per_s", "total_tokens_per_s"]
               if args.workload == "throughput"
               else ["engine", "tpot_ms", "batch_size", "ttft_ms", "roofline_ms", "roofline_pct"])
    quant = engine.quantization
    meta = {"workload": args.workload, "model": engine.router.source.name, "dtype": str(engine.dtype),
            "quantization": quant, "kv_cache_dtype": str(engine.runner.kv_cache_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "input_len": None if args.dataset else args.input_len,
            "output_len": args.output_len, "dataset": args.dataset,
            "repeats": args.repeats, "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    source = (f"{len(prompts)} prompts of {args.dataset} ({sum(map(len, prompts))} tokens in / "
              f"{sum(output_lens)} out)" if args.dataset else f"{args.input_len} in / {args.output_len} out")
    weights = f", {quant} weights" + (" (baseline: unquantized)" if model is not None else "") if quant else ""
    print(f"\n{args.workload}: {meta['model']} {meta['dtype']}{weights}, {meta['threads']} threads, "
          f"{source}, median of {args.repeats}")
    print(markdown_table(rows, columns, "transformers" if model is not None else None,
                         higher_is_better=args.workload == "throughput"))
    if roofline is not None:
        meta["roofline"] = dataclasses.asdict(roofline)
        experts = (f" + {roofline.expert_share:.0%} per token of {roofline.expert_bytes / 1e9:.3f} GB of routed experts"
                   if roofline.expert_bytes else "")
        print(f"roofline: {roofline.weight_bytes / 1e9:.3f} GB of weights{experts} + "
              f"{roofline.kv_bytes_per_token / 1e3:.1f} kB of KV per cached token per step"
              + "".join(f" + {b / 1e3:.1f} kB per token of the last {w}" for w, b in roofline.windowed_kv)
              + ", over "
              f"{roofline.bandwidth_gbs:.1f} GB/s (copy bandwidth of {engine.runner.device})")
    if args.output_json:
        write_json(Path(args.output_json), meta, rows)
    if args.plot and args.workload == "latency":
        if len(sizes) > 1:
            plot_latency_sweep(rows, Path(args.plot))
        else:
            print("--plot: a sweep needs more than one --batch-sizes value; no plot written")
    return 0


def _embed(args: argparse.Namespace, llm, entries: list[DatasetEntry] | None) -> int:
    from tessera.bench.embeddings import load_transformers_backbone, tessera_embed, transformers_embed

    engine = llm.engine
    prompts, _ = _requests(args, engine, args.num_prompts, entries)
    row, vectors = tessera_embed(llm, prompts, args.repeats)
    rows = [row]
    if args.baseline == "transformers":
        if engine.router.source.is_gguf:
            raise SystemExit("embed --baseline transformers: give a Hugging Face folder (or --preset)")
        dummy = engine.config.model.load_format == "dummy"
        model = load_transformers_backbone(str(engine.router.source.path), engine.dtype, dummy,
                                           engine.runner.device, classifier=engine.pooler_config.task == "classify")
        rows.append(transformers_embed(model, prompts, engine.pooler_config, args.embed_batch_size,
                                       args.repeats, None if dummy else vectors))
    pooler = engine.pooler_config
    meta = {"workload": "embed", "model": engine.router.source.name, "dtype": str(engine.dtype),
            "pooling": pooler.pooling_type, "normalize": pooler.normalize, "threads": torch.get_num_threads(),
            "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "repeats": args.repeats,
            "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    meta["task"] = pooler.task
    print(f"\nembed: {meta['model']} {meta['dtype']}, {pooler.task}, {pooler.pooling_type} pooling, {meta['threads']} threads, "
          f"{len(prompts)} prompts ({meta['prompt_tokens']} tokens), median of {args.repeats}")
    print(markdown_table(rows, ["engine", "tokens_per_s", "prompts_per_s", "elapsed_s", "padded_batch"],
                         "transformers" if len(rows) > 1 else None, higher_is_better=True))
    if len(rows) > 1:
        base = rows[1]
        if base.max_logit_diff is not None:
            print(f"agreement: largest |logit difference| between transformers and tessera {base.max_logit_diff:.6f}")
        elif base.min_cosine is not None:
            print(f"agreement: least cosine similarity of transformers' vectors to tessera's {base.min_cosine:.6f}")
        else:
            print("agreement: not compared (random weights: each engine draws its own)")
    if args.output_json:
        write_json(Path(args.output_json), meta, rows)
    return 0
