"""Benchmark harness: one fresh process per cell, an exactness gate, one table.

A cell whose output bytes differ from B0's is reported as NOT EXACT and is never credited with a
speedup. Peak memory is the caching allocator's peak for the whole cell process (weights, region
buffers, graphs and staging buffers included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence


def run_cells(script: str, cells: Sequence[str], args: Sequence[str], *, blocks: int = 1) -> list[dict]:
    """Run ``script --one CELL --out FILE ARGS`` in a fresh process per (block, cell); return the rows."""
    rows = []
    for block in range(blocks):
        for cell in cells:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "cell.json"
                cmd = [sys.executable, script, "--one", cell, "--out", str(out), "--block", str(block), *args]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if proc.returncode != 0 or not out.exists():
                    tail = (proc.stdout + proc.stderr)[-3000:]
                    rows.append(dict(name=cell, block=block, error=tail))
                    print(f"[{cell} block {block}] FAILED\n{tail}", file=sys.stderr)
                    continue
                row = json.loads(out.read_text())
                row["block"] = block
                rows.append(row)
                print(f"[{cell} block {block}] p50 {row['p50_ms']:.2f} ms, peak {row.get('peak_mib')}, "
                      f"sha {row['sha256'][:12]}", file=sys.stderr, flush=True)
    return rows


def gate(rows: list[dict], baseline: str = "B0") -> list[dict]:
    """Mark exactness per block against the baseline cell of the same block; compute speedups."""
    base = {r["block"]: r for r in rows if r["name"] == baseline and "error" not in r}
    for r in rows:
        b = base.get(r["block"])
        if "error" in r or b is None:
            r["bitexact"], r["speedup"] = False, None
            continue
        r["bitexact"] = r["sha256"] == b["sha256"]
        r["speedup"] = b["p50_ms"] / r["p50_ms"] if r["bitexact"] else None
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'cell':<12}{'block':>6}{'p50 ms':>10}{'p95 ms':>10}{'peak MiB':>10}{'kernels':>9}{'launches':>9}{'busy ms':>9}"
            f"{'warmup s':>9}{'exact':>7}{'speedup':>9}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<12}{r['block']:>6}  failed: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else ("-" if r["bitexact"] else "NOT EXACT")
        pk = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "n/a"
        kn = f"{r['kernels_per_chunk']:.0f}" if r.get("kernels_per_chunk") == r.get("kernels_per_chunk") else "n/a"
        la = f"{r['launches_per_chunk']:.0f}" if r.get("launches_per_chunk") == r.get("launches_per_chunk") else "n/a"
        bz = f"{r['busy_ms']:.1f}" if r.get("busy_ms") == r.get("busy_ms") and r.get("busy_ms") is not None else "n/a"
        lines.append(f"{r['name']:<12}{r['block']:>6}{r['p50_ms']:>10.2f}{r['p95_ms']:>10.2f}{pk:>10}{kn:>9}{la:>9}{bz:>9}"
                     f"{r.get('warmup_s', 0):>9.2f}{str(r['bitexact']):>7}{sp:>9}  {r.get('notes', '')}")
    return "\n".join(lines)
