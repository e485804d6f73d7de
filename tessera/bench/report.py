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


# one panel: (title, y label, {line label: y values}); every line shares the x labels
Panel = tuple[str, str, dict[str, list[float]]]


def plot_panels(path: Path, xlabel: str, xs: list[str], panels: list[Panel]) -> None:
    """Side-by-side line plots against the same categorical x axis (a sweep), written as a PNG."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, lines) in zip(axes[0], panels):
        for label, ys in lines.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        if len(lines) > 1:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency_sweep(rows: list, path: Path) -> None:
    """TPOT and TTFT against batch size (LatencyResult rows), one line per engine."""
    sizes = list(dict.fromkeys(r.batch_size for r in rows))
    engines = list(dict.fromkeys(r.engine for r in rows))

    def lines(metric: str) -> dict[str, list[float]]:
        by = {(r.engine, r.batch_size): getattr(r, metric) for r in rows}
        return {e: [by[e, b] for b in sizes] for e in engines}

    plot_panels(path, "batch size", [str(b) for b in sizes],
                [("Time per output token", "TPOT (ms)", lines("tpot_ms")),
                 ("Time to first token", "TTFT (ms)", lines("ttft_ms"))])
