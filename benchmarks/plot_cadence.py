"""Plot chunk latency against concurrent conversations from a cadence JSON (benchmarks/cadence.py).

    python benchmarks/plot_cadence.py docs/results/cadence-h200.json docs/results/cadence-h200.png
    python benchmarks/plot_cadence.py src.json stock.json out.png     # rows of several runs in one plot

One line per (cell, GPU count, lanes): p99 solid, p50 dashed in the same colour; rows with misses are
annotated; the horizontal line is the 1 s deadline (one chunk of audio). Rows without a ``gpus``
field (reports written before multi-GPU placement) count as one GPU.
"""

from __future__ import annotations

import json
import sys

LABELS = {"SRc": "cadence_fx SRc sessions", "stock": "stock driver, one process per session"}
COLORS = {("SRc", 1): "tab:blue", ("SRc", 2): "tab:green", ("stock", 1): "tab:gray", ("stock", 2): "tab:brown"}
SPARE = ["tab:purple", "tab:olive", "tab:cyan", "tab:pink", "tab:orange"]


def series(rows: list[dict]) -> dict[tuple[str, int, int | None], list[tuple]]:
    """(cell, gpus, lanes) -> sorted [(n_sessions, p50_ms, p99_ms, misses, bitexact)] of the rows that
    ran (``lanes``: the SRc program's, None for the stock cell and rows that do not say)."""
    out: dict[tuple[str, int, int | None], list[tuple]] = {}
    for r in rows:
        if "error" in r or r.get("p99_ms") is None:
            continue
        cell = r.get("cell") or r.get("name")
        key = (cell, int(r.get("gpus") or 1), r.get("lanes") if cell != "stock" else None)
        out.setdefault(key, []).append((r["n_sessions"], r["p50_ms"], r["p99_ms"], r["misses"], r.get("bitexact")))
    return {k: sorted(v) for k, v in sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0))}


def main(srcs: list[str], dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.load(open(src)) for src in srcs]
    rows = [r for d in docs for r in (d["rows"] if isinstance(d, dict) else d)]
    data = next((d for d in docs if isinstance(d, dict)), {})
    period_ms = 1e3 * data.get("period_s", 1.0)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    spare = iter(SPARE)
    used: set[str] = set()
    for (cell, gpus, lanes), pts in series(rows).items():
        color = COLORS.get((cell, gpus))
        color = color if color and color not in used else next(spare, "black")
        used.add(color)
        n = [p[0] for p in pts]
        label = f"{LABELS.get(cell, cell)}{f', {lanes} lanes' if lanes else ''}, {gpus} GPU{'s' if gpus > 1 else ''}"
        ax.plot(n, [p[2] for p in pts], "o-", color=color, label=f"{label}: p99")
        ax.plot(n, [p[1] for p in pts], "o--", color=color, alpha=0.5, label=f"{label}: p50")
        for x, _p50, p99, miss, exact in pts:
            note = ", ".join(s for s in (f"{miss} misses" if miss else "", "NOT EXACT" if exact is False else "") if s)
            if note:
                ax.annotate(note, (x, p99), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    ax.axhline(period_ms, color="tab:red", lw=1, label=f"{period_ms / 1e3:g} s deadline (one chunk of audio)")
    ax.set_yscale("log")
    device, dtype = data.get("device"), data.get("dtype", "float32")
    model = "demo decoder (smoke run)" if data.get("model") == "demo" else "Token2Wav"
    ax.set_xlabel(f"concurrent conversations ({model}, {dtype}{', ' + device if device else ''})")
    ax.set_ylabel("chunk latency, arrival to PCM on host (ms)")
    ax.legend(fontsize=6.5, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:-1], sys.argv[-1])
