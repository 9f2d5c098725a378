"""Per-chunk latency across the stream for B0 and the optimized cells, with the 1 s cadence budget.

    python benchmarks/plot_token2wav.py docs/results/token2wav-h200.json docs/results/token2wav-h200.png [RUN]

With several runs merged in the JSON, RUN picks the one whose rows are drawn (default: the last run
that has every cell), so the curves are one run's.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str, run: int | None = None, cells: tuple[str, ...] = ("B0", "SRc", "SR", "compile")) -> None:
    data = json.load(open(src))
    if run is None:
        runs = sorted({r.get("run", 0) for r in data["cells"]})
        run = max((k for k in runs if all(any(r["name"] == c and r.get("run", 0) == k for r in data["cells"])
                                             for c in cells)), default=runs[-1])
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in cells:
        rows = [r for r in data["cells"] if r["name"] == name and r.get("block") == 0 and r.get("ms")
                and r.get("run", 0) == run]
        if not rows:
            continue
        row = rows[-1]
        exact = "bit-exact" if row.get("bitexact") else "NOT bit-exact"
        ax.plot(range(1, len(row["ms"]) + 1), row["ms"], marker=".", label=f"{name} (block 0, {exact} with B0)")
    ax.axhline(1000, color="red", linestyle="--", label="1 s cadence budget")
    ax.set_yscale("log")
    ax.set_xlabel("chunk (25 tokens = 1 s of speech)")
    ax.set_ylabel("wall time per chunk, ms")
    ax.set_title(f"Token2Wav streaming, {data['gpu']}, torch {data['torch']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
