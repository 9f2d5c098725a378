"""The stock cell's processes: the stock driver as it ships, one process (one model) per session.

:func:`run_stock_child` is one process (``benchmarks/cadence.py --child I``): it builds the model, says
it is ready, waits for the row's shared ``t0`` and runs its session's conversation from the prompt
state as the stock driver does. :class:`StockRow` is the coordinator's side: the N processes of one
row, started when the row comes and closed after it. They talk through files in one folder
(``readyI``, ``go``, ``stop``, ``sI.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks import harness
from benchmarks.cadence_model import build_bench, child_setup, device_name
from benchmarks.cadence_placement import child_env, passthrough, spawn
from benchmarks.cadence_traffic import chunks_per_session, first_arrival, script_tokens
from cadence_fx.determinism import sha256_tensors

if TYPE_CHECKING:
    from benchmarks.cadence_run import Run


def run_stock_child(args) -> None:
    """One stock process of a :class:`StockRow`: build the model, say ready, wait for the row's t0 (or
    ``stop``), run one conversation from the prompt state as the stock driver does, write the result."""
    device = child_setup()
    if device == "cuda":
        torch.set_num_threads(args.threads)
    bench = build_bench(args, device)
    step = bench.step
    script = args.child % args.scripts
    chunks = chunks_per_session(args.seconds, args.period)
    fresh = script_tokens(bench, script, chunks)
    d = Path(args.dir)
    (d / f"ready{args.child}").write_text("1")
    while not (d / "go").exists():
        if (d / "stop").exists():
            return
        time.sleep(0.05)
    t0 = float((d / "go").read_text())
    start = first_arrival(t0, args.child, args.n, args.period)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(script)
    st, pcm, records = dict(bench.state0), [], []
    for k, f in enumerate(fresh):
        arrive = start + k * args.period
        wait = arrive - time.time()
        if wait > 0:
            time.sleep(wait)
        with torch.no_grad():
            out = step.driver_call(*step.next_args(f, st))
        pcm.append(out[0].cpu())
        records.append([args.child, k, arrive - t0, time.time() - t0])
        st = step.carry(out)
    tmp = d / f"s{args.child}.tmp"
    tmp.write_text(json.dumps(dict(records=records, sha=sha256_tensors(pcm), peak_mib=harness.peak_mib(),
                                   device=device_name(device))))
    os.replace(tmp, d / f"s{args.child}.json")


class StockRow:
    """The stock cell's processes of one row: N of them, one per session, pinned to the GPUs round robin,
    each building its model; :meth:`serve` starts them all on one shared t0, each running its
    conversation from the prompt state. Built when the row comes and closed after it, so no row (of
    either cell) runs beside idle stock processes: an idle process submits no work, yet its CUDA
    context on the GPU slowed its neighbours measurably (session 14).

    Each process gets ``cpu_count // N`` intra-op threads (at least 1): the stock step is host-bound,
    and N processes with a thread per core each would oversubscribe the host N times."""

    def __init__(self, run: Run, g: int, n: int) -> None:
        a = run.args
        self.g, self.n = g, n
        self.dir = Path(tempfile.mkdtemp(prefix="cadence-stock-"))
        self.threads = max(1, (os.cpu_count() or 1) // n)
        self.t_start = time.time()
        self.build_s: float | None = None
        self.procs = []
        for i in range(n):
            flags = ["--child", str(i), "--n", str(n), "--dir", str(self.dir),
                     "--threads", str(self.threads), "--seconds", str(a.seconds)] + passthrough(a)
            self.procs.append(spawn(flags, self.dir / f"s{i}.err", child_env(run.visible, i % g)))

    def _dead(self) -> str | None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None and not (self.dir / f"s{i}.json").exists():
                return f"stock process {i} exited (rc {p.returncode}):\n" + (self.dir / f"s{i}.err").read_text()[-3000:]
        return None

    def wait_ready(self) -> str | None:
        """Until every model is built; the error of a process that died instead."""
        while sum((self.dir / f"ready{i}").exists() for i in range(self.n)) < self.n:
            if (error := self._dead()):
                return error
            time.sleep(0.2)
        self.build_s = max((self.dir / f"ready{i}").stat().st_mtime for i in range(self.n)) - self.t_start
        return None

    def serve(self, t0: float) -> list[dict] | str:
        """Every process runs its conversation from ``t0``; their results, or an error."""
        (self.dir / "go.tmp").write_text(repr(t0))
        os.replace(self.dir / "go.tmp", self.dir / "go")  # whole, or not there
        outs = [self.dir / f"s{i}.json" for i in range(self.n)]
        while not all(f.exists() for f in outs):
            if (error := self._dead()):
                return error
            time.sleep(0.2)
        return [json.loads(f.read_text()) for f in outs]

    def facts(self) -> dict:
        return dict(gpus=self.g, processes=self.n, threads_per_process=self.threads, build_s=self.build_s)

    def close(self) -> None:
        (self.dir / "stop").write_text("1")  # a process still waiting for its go (a row that failed) ends
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
