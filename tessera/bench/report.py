"""Markdown tables and JSON for benchmark results, with tessera / baseline ratios."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def markdown_table(rows: list[object], columns: list[str], baseline: str | None = None,
                   higher_is_better: bool = True) -> str:
    """One row per result. With a baseline, a `speedup` column compares the first metric
    column with the baseline's row of the same batch size (>1 means tessera is faster)."""
    key = columns[1]
    base = {}
    for row in rows:
        d = dataclasses.asdict(row)
        if baseline and d["engine"] == baseline:
            base[d.get("batch_size")] = d[key]
    header = columns + ([f"speedup vs {baseline}"] if base else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        d = dataclasses.asdict(row)
        cells = [f"{d[c]:.2f}" if isinstance(d[c], float) else str(d[c]) for c in columns]
        if base:
            ref = base.get(d.get("batch_size"))
            ratio = (d[key] / ref if higher_is_better else ref / d[key]) if ref else None
            cells.append(f"{ratio:.2f}x" if ratio else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, meta: dict, rows: list[object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [dataclasses.asdict(r) for r in rows]}, indent=2))
