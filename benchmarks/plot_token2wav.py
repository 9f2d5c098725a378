"""Every Token2Wav cell of a report: latency per chunk and peak memory, each beside its own baseline.

    python benchmarks/plot_token2wav.py docs/results/token2wav-h200.json docs/results/token2wav-h200.png

Left: per cell, the median over blocks of the per-block p50 (bar) and the largest block p95 (tick),
log scale, with the 1 s cadence budget. Right: peak MiB. A cell's label names the run (device call) it
ran in and the baseline it is gated against; hatched bars are cells whose bytes differ from that
baseline (no speedup is credited to them). Runs merged into one report stay apart: each cell is
compared only with the baseline of its own run.
"""

from __future__ import annotations

import json
import sys

from harness import percentile  # the report's own median, so the plot shows its numbers

ORDER = ("B0", "vendor", "vendor_live", "compile", "S", "R", "Rc", "SR", "SRc", "SRc1", "B0h", "SRch", "B0n", "SRcn")


def _cells(data: dict) -> list[dict]:
    """One entry per (cell, run): block p50s' median, worst p95, peak, exactness, baseline."""
    out: dict[tuple[str, int], dict] = {}
    for r in data["cells"]:
        if "error" in r:
            continue
        e = out.setdefault((r["name"], r.get("run", 0)), dict(name=r["name"], run=r.get("run", 0), p50=[], p95=[],
                                                               peak=0.0, exact=True, baseline=r.get("baseline", "B0")))
        e["p50"].append(r["p50_ms"])
        e["p95"].append(r["p95_ms"])
        e["peak"] = max(e["peak"], r.get("peak_mib") or 0.0)
        e["exact"] = e["exact"] and bool(r.get("bitexact"))
    rank = {n: i for i, n in enumerate(ORDER)}
    cells = sorted(out.values(), key=lambda e: (e["run"], rank.get(e["name"], len(ORDER)), e["name"]))
    for e in cells:
        e["p50"] = percentile(e["p50"], 50)
        e["p95"] = max(e["p95"])
    return cells


def main(src: str, dst: str) -> None:
    import matplotlib  # the bench extra (pyproject): only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    cells = _cells(data)
    labels = [f"{e['name']} (call {e['run'] + 1}" + ("" if e["name"] == e["baseline"] else f", vs {e['baseline']}") + ")"
              for e in cells]
    colors = ["tab:gray" if e["name"].startswith("B0") else "tab:orange" if e["name"] in ("vendor", "vendor_live", "compile")
              else "tab:blue" for e in cells]
    hatch = [None if e["exact"] else "//" for e in cells]
    y = range(len(cells))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 0.42 * len(cells) + 1.6), sharey=True)
    bars = ax.barh(y, [e["p50"] for e in cells], color=colors)
    ax.scatter([e["p95"] for e in cells], y, marker="|", color="black", s=120, label="p95 (worst block)", zorder=3)
    ax.axvline(1000, color="red", linestyle="--", label="1 s cadence budget")
    ax.set_xscale("log")
    ax.set_xlabel("ms per 1 s chunk (p50, median of blocks)")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    pbars = bx.barh(y, [e["peak"] for e in cells], color=colors)
    bx.set_xlabel("peak MiB (torch.cuda.max_memory_allocated)")
    for bs in (bars, pbars):
        for b, h in zip(bs, hatch):
            if h:
                b.set_hatch(h)
                b.set_edgecolor("black")
    for i, e in enumerate(cells):
        ax.text(e["p50"] * 1.05, i, f"{e['p50']:.1f}" + ("" if e["exact"] else " (not bit-exact)"), va="center", fontsize=7)
        bx.text(e["peak"] * 1.01, i, f"{e['peak']:,.0f}", va="center", fontsize=7)
    fig.suptitle(f"Token2Wav released sizes, {data['gpu']}, torch {data['torch']}, {data.get('date', '')}: grey stock, "
                 f"orange vendor / torch.compile, blue cadence_fx; hatched = bytes differ from its baseline", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
