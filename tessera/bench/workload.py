"""Benchmark workloads: reproducible random-token prompts of fixed length, or the prompts of a
JSONL dataset."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0

    def prompts(self, vocab_size: int, avoid: frozenset[int] = frozenset()) -> list[list[int]]:
        """Random token ids in [100, vocab), so special tokens (low ids, EOS) never appear."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(100, vocab_size, (self.num_prompts, self.input_len), generator=g).tolist()
        return [[t if t not in avoid else 100 for t in row] for row in ids]


@dataclass(frozen=True)
class DatasetEntry:
    prompt: str
    output_len: int | None  # None: the command's --output-len


def read_dataset(path: Path) -> list[DatasetEntry]:
    """Every {"prompt": str, "output_len": int (optional)} line of a JSONL file (blank lines
    skipped); a bad line exits with its line number."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"--dataset {path}: {e.strerror or e}") from None
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--dataset {path}, line {number}: not JSON ({e.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        output_len = item.get("output_len") if isinstance(item, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise SystemExit(f"--dataset {path}, line {number}: expected {{\"prompt\": \"text\"}}, "
                             f"got {line.strip()[:80]}")
        if output_len is not None and (not isinstance(output_len, int) or isinstance(output_len, bool)
                                       or output_len < 1):
            raise SystemExit(f"--dataset {path}, line {number}: output_len must be a positive integer, "
                             f"got {output_len!r}")
        entries.append(DatasetEntry(prompt, output_len))
    if not entries:
        raise SystemExit(f"--dataset {path}: no {{\"prompt\": ...}} lines")
    return entries


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
