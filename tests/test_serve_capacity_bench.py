"""The front-end capacity benchmark's path on the CPU, end to end: ``benchmarks/serve_capacity.py --model demo``.

The demo decoder's artifact built and saved (with its inputs file), loaded in process with one lane:
the solo runs, then N = 1 and 2 conversations at a half-second cadence; then a Ray head on this
machine, the controller and one worker from the artifact, the front end on Ray Serve over
``RayBackend``, and N WebSocket clients at the same cadence. Every stream of every row against its
script's solo run by SHA-256. In a subprocess (its own ``ray.init``, apart from any cluster another
module of the run holds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_bench_report

pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("websockets")

ROOT = Path(__file__).resolve().parents[1]


def test_capacity_benchmark_serves_every_row_in_process_and_through_the_front_end_exactly(tmp_path):
    out = tmp_path / "capacity.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_capacity.py"), "--model", "demo", "--lanes", "1",
           "--sessions", "1,2", "--seconds", "2", "--period", "0.5", "--artifact", str(tmp_path / "demo.cfx"),
           "--json", str(out), "--no-worker-logs", "--ray-cpus", "2"]
    rep = run_bench_report(cmd, out, timeout=180)
    assert (tmp_path / "demo.cfx.inputs.pt").exists() and rep["artifact"]["built"]
    rows = {(r["mode"], r["sessions"]): r for r in rep["rows"]}
    assert set(rows) == {(m, n) for m in ("in_process", "service") for n in (1, 2)}
    for r in rows.values():
        assert r["exact"] and r["streams_exact"] == r["sessions"], r
        assert r["chunks"] == 4 * r["sessions"] and r["latency"]["n"] == r["chunks"]
    assert set(rep["by_sessions"]) == {"1", "2"}
    cap = rep["capacity"]
    assert set(cap) >= {"in_process", "service", "ratio", "target", "met"} and cap["target"] == 0.95
    assert rep["exact"] is True and rep["torch"] and rep["date"] and "serve_capacity.py" in rep["command"]
