"""`tessera bench serve`: the serving benchmark against a running server (`tessera serve`,
TGI, vLLM, ...), one level per --concurrency value. No engine is built in this process."""
from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

from tessera.bench.report import markdown_table, write_json
from tessera.bench.serve_client import Backend, request_body, run_level, poisson_schedule, served_model
from tessera.bench.serve_report import (LATENCY_COLUMNS, SUMMARY_COLUMNS, LevelResult, latency_rows,
                                        plot_sweep, summarize)
from tessera.bench.workload import read_dataset

# Short common words: most tokenizers give each one token (with its leading space), so a
# prompt of N words is close to N tokens; the exact count the server reports is in the JSON.
WORDS = ("the of and to in is was for on as with by at from his an were are which this be has "
         "had one not but its new first also after two who they their time she her year can more "
         "he all other some into only over used city part most such well then many may these when "
         "three made both later under four where world any high known while each war life name "
         "long game early work team film back since five end own how music state called found").split()


def random_prompts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(num)]


def dataset_prompts(path: Path, num: int) -> list[str]:
    """The first `num` {"prompt": ...} lines of a JSONL file, cycled if it has fewer."""
    prompts = [entry.prompt for entry in read_dataset(path)]
    return [prompts[i % len(prompts)] for i in range(num)]


def concurrency_levels(text: str | None) -> list[int | None]:
    """"1,4,16" -> [1, 4, 16]; nothing -> [None] (no cap: the request rate alone sets the load)."""
    if not text:
        return [None]
    levels = [int(part) for part in text.split(",") if part.strip()]
    if any(c < 1 for c in levels):
        raise SystemExit("--concurrency values must be >= 1")
    return levels


def run_serve_bench(args: argparse.Namespace) -> int:
    if not args.url:
        raise SystemExit("tessera bench serve needs --url of a running server (start `tessera serve` first)")
    backend: Backend = args.backend
    model = args.model if args.model else (served_model(args.url) if backend != "tgi" else None)

    def bodies(seed: int, num: int) -> list[dict]:
        # Random prompts are fresh per level (seed + level index): a repeated prompt would hit
        # the server's prefix cache and flatter the later levels' TTFT. A dataset is reused.
        prompts = (dataset_prompts(Path(args.dataset), num) if args.dataset
                   else random_prompts(num, args.input_len, seed))
        return [request_body(backend, p, args.output_len, model) for p in prompts]

    if args.warmup:  # one untimed request first (as vLLM's initial test prompt): first-call costs stay out
        asyncio.run(run_level(args.url, backend, bodies(args.seed - 1, 1), 1, [0.0], timeout_s=args.timeout,
                              progress=False))
    schedule = poisson_schedule(args.num_prompts, args.request_rate, args.seed)
    results: list[LevelResult] = []
    for i, level in enumerate(concurrency_levels(args.concurrency)):
        run = asyncio.run(run_level(args.url, backend, bodies(args.seed + i, args.num_prompts), level, schedule,
                                    timeout_s=args.timeout))
        results.append(summarize(run, level, args.request_rate))
    meta = {"workload": "serve", "url": args.url, "backend": backend, "model": model,
            "num_prompts": args.num_prompts, "input_len": None if args.dataset else args.input_len,
            "dataset": args.dataset, "output_len": args.output_len, "request_rate": args.request_rate,
            "seed": args.seed, "warmup": args.warmup}
    source = args.dataset or f"{args.input_len} random words"
    print(f"\nserve: {args.url} ({backend}), {args.num_prompts} prompts of {source}, "
          f"{args.output_len} out, request rate {args.request_rate}")
    print(markdown_table(results, SUMMARY_COLUMNS))
    print()
    print(markdown_table(latency_rows(results), LATENCY_COLUMNS))
    for r in results:
        for error in r.errors:
            print(f"concurrency {r.concurrency}: failed: {error}")
    if args.output_json:
        write_json(Path(args.output_json), meta, results)
    if args.plot and len(results) > 1:
        plot_sweep(results, Path(args.plot))
    return 0 if any(r.completed for r in results) else 1
