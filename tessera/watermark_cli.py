"""`tessera detect-watermark`: test texts for the engine's green-list watermark. It needs
the model's tokenizer and vocabulary size, not its weights, so it starts in seconds."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tessera.config import DEFAULT_WATERMARK_Z_THRESHOLD, MODEL_IMPLS


def add_detect_parser(sub: argparse._SubParsersAction, add_watermark_args) -> None:
    det = sub.add_parser("detect-watermark",
                         help="test texts for the watermark that `--watermark` / TGI's `watermark` adds")
    det.add_argument("texts", nargs="*", help="texts to test (default: --input-file, else standard input)")
    det.add_argument("--input-file", metavar="FILE", help="a text file tested whole, or JSONL: strings, or objects "
                                          "with \"text\" or \"token_ids\" and an optional \"prompt\" "
                                          "(`tessera generate --output-file` writes these)")
    det.add_argument("--prompt", default=None,
                     help="the prompt the texts answered: its last token seeds the first token's list")
    det.add_argument("--model", default=None,
                     help="the model that generated (its tokenizer and vocabulary size; default: "
                          "the embedded SmolLM2-135M-Instruct)")
    det.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    det.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS)
    det.add_argument("--z-threshold", type=float, default=DEFAULT_WATERMARK_Z_THRESHOLD,
                     help="z-score above which a text is called watermarked (default 4: about one "
                          "false positive in 30,000 texts)")
    det.add_argument("--ignore-repeated-bigrams", action="store_true",
                     help="count each (previous, token) pair once, so repetitive text cannot pass on a few pairs")
    det.add_argument("--json", action="store_true", help="one JSON object a text")
    add_watermark_args(det)
    det.set_defaults(func=cmd_detect_watermark)


Test = tuple[str | list[int], str | list[int] | None]  # (text or token ids, prompt)


def _tests(args: argparse.Namespace) -> list[Test]:
    """(output, prompt) pairs from the arguments, the input file or standard input."""
    if args.texts and args.input_file is not None:
        raise ValueError("give texts or --input-file, not both")
    if args.texts:
        return [(text, args.prompt) for text in args.texts]
    if args.input_file is None:
        return [(sys.stdin.read(), args.prompt)]
    path = Path(args.input_file)
    content = path.read_text(encoding="utf-8")
    items = _json_lines(content)
    if items is None:
        if path.suffix == ".jsonl":
            items = [_json_line(path, number, line) for number, line in _lines(content)]
        else:  # a text, tested whole
            return [(content, args.prompt)]
    tests: list[Test] = []
    for number, item in items:
        if isinstance(item, str):
            tests.append((item, args.prompt))
            continue
        outputs = item.get("completions", [item]) if isinstance(item, dict) else []
        found = [_output(o) for o in outputs if isinstance(o, dict)]
        if not found or None in found:
            raise ValueError(f"{path}:{number}: expected a string, or an object with \"text\" or "
                             "\"token_ids\" (as `tessera generate --output-file` writes)")
        tests += [(output, _prompt(item, args.prompt)) for output in found]
    return tests


def _lines(content: str) -> list[tuple[int, str]]:
    return [(number, line) for number, line in enumerate(content.splitlines(), 1) if line.strip()]


def _json_line(path: Path, number: int, line: str):
    try:
        return number, json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc})") from None


def _json_lines(content: str) -> list[tuple[int, object]] | None:
    """The lines as JSON strings and objects, when every line is one (JSONL whatever the
    file is called: `generate --output-file` takes any name); else None (a text)."""
    items = []
    for number, line in _lines(content):
        try:
            item = json.loads(line)
        except ValueError:
            return None
        if not isinstance(item, (str, dict)):
            return None
        items.append((number, item))
    return items or None


def _output(record: dict) -> str | list[int] | None:
    """A record's token ids when it has them (exact: no re-tokenization), else its text."""
    ids = record.get("token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return ids
    return record["text"] if isinstance(record.get("text"), str) else None


def _prompt(record: dict, default: str | None) -> str | list[int] | None:
    """The prompt as the model read it: its ids (a chat prompt's include the template), or
    its text."""
    ids = record.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return ids
    return record["prompt"] if isinstance(record.get("prompt"), str) else default


def cmd_detect_watermark(args: argparse.Namespace) -> int:
    from tessera.engine_args import watermark_config
    from tessera.config import ModelConfig
    from tessera.models.registry import get_router
    from tessera.sampling.watermark import detect_watermark_in_output

    config = watermark_config(args)
    tests = _tests(args)
    router = get_router(ModelConfig(model=args.model, tokenizer=args.tokenizer, model_impl=args.model_impl))
    failed = 0
    for output, prompt in tests:
        try:
            score = detect_watermark_in_output(router.tokenizer, router.config.vocab_size, config, output,
                                               prompt=prompt, z_threshold=args.z_threshold,
                                               ignore_repeated_bigrams=args.ignore_repeated_bigrams)
        except ValueError as exc:  # too short: the others are still tested
            failed += 1
            print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}")
            continue
        if args.json:
            print(json.dumps(asdict(score)))
        else:
            verdict = "watermarked" if score.prediction else "not watermarked"
            print(f"{verdict}: z = {score.z_score:.2f} (threshold {score.z_threshold:g}), "
                  f"{score.num_green_tokens} of {score.num_tokens_scored} tokens green "
                  f"({score.green_fraction:.1%}; {config.gamma:.0%} expected), p = {score.p_value:.2g}")
    return 1 if failed else 0
