"""Per-chunk latency across the stream for B0 and the optimized cells, with the 1 s cadence budget.

    python benchmarks/plot_token2wav.py docs/results/token2wav-h200.json docs/results/token2wav-h200.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str, cells: tuple[str, ...] = ("B0", "SRc", "SR", "compile")) -> None:
    data = json.load(open(src))
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in cells:
        rows = [r for r in data["cells"] if r["name"] == name and r.get("block") == 0 and r.get("ms")]
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
    main(sys.argv[1], sys.argv[2])
