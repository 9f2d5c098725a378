"""Plot latency percentiles against conversations per GPU from a cadence JSON (benchmarks/cadence.py).

    python benchmarks/plot_cadence.py docs/results/cadence-h200.json docs/results/cadence-h200.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    rows = data["rows"] if isinstance(data, dict) else data
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for cell, color in (("SRc", "tab:blue"), ("stock", "tab:gray")):
        pts = sorted((r["n_sessions"], r["p50_ms"], r["p99_ms"], r["misses"]) for r in rows
                     if r.get("name") == cell and "error" not in r)
        if not pts:
            continue
        n = [p[0] for p in pts]
        label = "cadence_fx SRc sessions" if cell == "SRc" else "stock driver, one process per session"
        ax.plot(n, [p[2] for p in pts], "o-", color=color, label=f"{label}: p99")
        ax.plot(n, [p[1] for p in pts], "o--", color=color, alpha=0.6, label=f"{label}: p50")
        for x, _p50, p99, miss in pts:
            if miss:
                ax.annotate(f"{miss} misses", (x, p99), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1000, color="tab:red", lw=1, label="1 s budget (one chunk of audio)")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent conversations on one H200 (Token2Wav, fp32, released sizes)")
    ax.set_ylabel("chunk latency, arrival to PCM on host (ms)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
