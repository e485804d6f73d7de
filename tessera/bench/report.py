"""Markdown tables and JSON for benchmark results, with tessera / baseline ratios."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def markdown_table(rows: list[object], columns: list[str], baseline: str | None = None) -> str:
    """One row per result; with a baseline, a ratio column for the first metric column."""
    key = columns[1] if len(columns) > 1 else None
    base = {}
    if baseline and key:
        for row in rows:
            d = dataclasses.asdict(row)
            if d["engine"] == baseline:
                base[tuple(d.get(c) for c in columns if c in ("batch_size",))] = d[key]
    header = columns + ([f"{key} vs {baseline}"] if base else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        d = dataclasses.asdict(row)
        cells = [f"{d[c]:.2f}" if isinstance(d[c], float) else str(d[c]) for c in columns]
        if base:
            ref = base.get(tuple(d.get(c) for c in columns if c in ("batch_size",)))
            cells.append(f"{d[key] / ref:.2f}x" if ref else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, meta: dict, rows: list[object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [dataclasses.asdict(r) for r in rows]}, indent=2))
