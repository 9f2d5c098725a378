"""The GPU serve benchmark's path on the CPU, end to end: ``benchmarks/serve_token2wav.py --model demo``.

Every phase the H200 run has, on the demo decoder (the reduced Token2Wav takes minutes on this CPU:
``--reduced``, run by hand): the stock step built, exported, optimized and saved; the solo runs and
the stock prefix; a Ray head on this machine (``address="local"``), two workers from the artifact,
routing through the controller and straight to a worker, a migration, checkpoints of both stores, a
SIGKILL of the worker while two of its conversations' chunks are in flight, every stream against its
solo run by SHA-256. In a subprocess (its own ``ray.init``, apart from any cluster another module of the
run holds), with the smallest counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_bench_report

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def test_serve_benchmark_runs_every_phase_end_to_end_with_every_stream_exact(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_token2wav.py"), "--model", "demo", "--json", str(out),
           "--chunks", "3", "--moves", "1", "--checkpoints", "1", "--every", "2", "--warm", "3", "--stock-chunks", "2",
           "--no-replacement", "--no-worker-logs", "--ray-cpus", "2", "--parallel-start"]
    rep = run_bench_report(cmd, out, timeout=240)
    assert rep["exact"] and rep["lost_chunks"] == 0 and rep["answered_twice"] == 0
    assert set(rep["streams"]) == {"routing", "router", "direct", "mover", "f0", "f1", "f2"}
    assert rep["stock_prefix_exact"] is True  # the served bytes are the stock driver's
    assert set(rep["ready"]) == {"worker-0", "worker-1"}
    assert rep["migration"]["bytes"] == rep["state_bytes"] > 0
    assert rep["migration"]["paths"] == ["host"] and rep["migration"]["host"]["n"] == 1  # CPU workers: no GPU to share
    assert rep["routing"]["router_latency"]["n"] == 3 and rep["routing"]["router_stats"]["chunks"] == 6
    fo = rep["failover"]
    assert all(w != "worker-0" for c, w in fo["served_by"].items())  # resumed on the survivor
    assert len(fo["resumes"]) == 2 and fo["replayed"] == [1, 1]  # every 2 chunks: half a period re-run
    assert set(rep["targets"]) == {"worker_ready_le_20s", "routing_added_p99_le_2ms", "routing_added_p99_le_5ms",
                                   "migration_le_100ms",
                                   "failover_le_3s_nothing_lost_identical", "checkpoint_le_5pct_capacity"}
