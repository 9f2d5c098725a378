"""One cadence benchmark run: the rows over N of each cell, in order, and the report they make.

:class:`Run` holds the run's rows, its solo digests (:class:`~benchmarks.cadence_exact.SoloDigests`) and
its set-up facts. For the SRc cell it drives the long-lived workers (:mod:`benchmarks.cadence_worker`):
an untimed warm stream first (:meth:`Run.warm`), then each GPU count's N upward (:meth:`Run.run_src`,
``--pack``: the same N side by side on disjoint GPUs; ``--procs-per-gpu``: several workers share each
GPU, optionally under an MPS daemon of the run's own, :mod:`benchmarks.cadence_mps`). For the stock cell it starts each row's own
processes (:class:`~benchmarks.cadence_stock.StockRow`, :meth:`Run.run_stock`). Every row is merged
(:func:`~benchmarks.cadence_rows.merge_row`) and written as it comes (:meth:`Run.add`); a list stops
at its first N with misses (``--full-sweep``: it goes on) or where ``--time-budget`` would be passed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from benchmarks import harness
from benchmarks.cadence_exact import SoloDigests, script_sha
from benchmarks.cadence_measure import NvmlSampler
from benchmarks.cadence_mps import CONNECTION_POOL, DRIVER_CONNECTIONS, MpsDaemon, client_connections
from benchmarks.cadence_placement import ENTRY, child_env, passthrough, sessions_of, visible_gpus
from benchmarks.cadence_rows import limits, merge_row, progress
from benchmarks.cadence_stock import StockRow
from benchmarks.cadence_traffic import chunks_per_session, latency_ms, missed
from benchmarks.cadence_worker import Worker, worker_env

T_START = time.monotonic()  # --time-budget counts from here (the coordinator's start)


def row_cutoff_s(period: float, chunks: int, slack: float) -> float:
    """Seconds from a row's t0 after which it is cut (``--row-slack`` past the last chunk's deadline):
    every chunk not yet served then has missed its deadline, so counting it as a miss is exact, and a
    row far slower than real time still ends (and a device call keeps its report)."""
    return period * (chunks + 1) + slack


DRAW_REPLAY_MODES = ("lock", "lockless")


def draw_replay_modes(spec: str) -> list[str]:
    """``--draw-replay``: the comma list of modes each N runs in, in order; an unknown mode is refused."""
    modes = [m.strip() for m in str(spec).split(",") if m.strip()]
    bad = [m for m in modes if m not in DRAW_REPLAY_MODES]
    if bad or not modes:
        raise SystemExit(f"--draw-replay {spec!r}: each entry must be one of {', '.join(DRAW_REPLAY_MODES)}")
    return modes


class Run(SoloDigests):
    """One benchmark run: the solo digests, the rows so far, and where they are written."""

    def __init__(self, args) -> None:
        self.args = args
        self.visible = visible_gpus()
        self.chunks = chunks_per_session(args.seconds, args.period)
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.solo: dict[int, str] = {}
        self.solo_gpu: dict[int, int] = {}
        self.device = None
        self.meta: dict = {}
        self.warm_s = args.warm_seconds if args.warm_seconds is not None else (10.0 if self.visible else 0.0)
        self.mps: MpsDaemon | None = None
        self._deferred: list[tuple[int, int]] = []  # (gpu, slot) of workers that start once slot 0 is ready
        self._share_dir: str | None = None  # --share-weights: where slot 0 publishes its weights
        # what the workers ask for, capped under MPS by start_workers (0: the driver's default)
        self.connections = getattr(args, "cuda_connections", 0)

    # ------------------------------------------------------------------ rows
    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(progress(row), file=sys.stderr, flush=True)
        if self.args.rows:
            harness.append_rows(self.args.rows, [row])
        if self.args.json:
            harness.write_json(self.args.json, self.report())

    def report(self) -> dict:
        return dict(command="python benchmarks/cadence.py " + " ".join(sys.argv[1:]), torch=torch.__version__,
                    device=self.device, date=time.strftime("%Y-%m-%d"), model=self.args.model, dtype=self.args.dtype,
                    reduced=self.args.reduced, seconds=self.args.seconds, period_s=self.args.period,
                    chunks_per_session=self.chunks,
                    scripts=self.args.scripts, warm_s=self.warm_s, solo_sha={str(k): v for k, v in self.solo.items()},
                    solo_gpu={str(k): v for k, v in self.solo_gpu.items()}, limits=limits(self.rows),
                    skipped=self.skipped, setup=self.meta, rows=self.rows)

    def over_budget(self, cell: str, g: int, n: int, need_s: float) -> bool:
        budget = self.args.time_budget
        if budget and time.monotonic() - T_START + need_s > budget:
            self.skipped.append(dict(cell=cell, gpus=g, n_sessions=n, reason=f"--time-budget {budget:.0f} s"))
            print(f"[{cell} gpus={g} N={n}] skipped: would end past --time-budget {budget:.0f} s", file=sys.stderr)
            return True
        return False

    # ------------------------------------------------------------------ SRc
    def start_workers(self, k: int) -> list[Worker]:
        """The SRc workers of ``k`` GPUs, ``--procs-per-gpu`` on each, in slot-major order (every GPU's
        slot 0 first). With ``--artifact`` not yet saved and more than one slot, only slot 0 starts now:
        it saves the artifact, and the other slots start from it once slot 0 is ready (:meth:`ready`)."""
        a = self.args
        if a.mps and self.mps is None:
            self.mps = MpsDaemon()
            self.mps.start(bool(self.visible))
            self.meta["mps"] = self.mps.facts
            if not self.mps.running:
                print(f"--mps: no MPS daemon ({self.mps.facts.get('error')}); the workers run without one",
                      file=sys.stderr, flush=True)
            else:
                self.connections = client_connections(a.cuda_connections, a.procs_per_gpu)
                if self.connections != (a.cuda_connections or DRIVER_CONNECTIONS):
                    print(f"--mps: {a.procs_per_gpu} workers per GPU share {CONNECTION_POOL} connections: "
                          f"{self.connections} each instead of --cuda-connections {a.cuda_connections}",
                          file=sys.stderr, flush=True)
                self.meta["mps"]["connections"] = self.connections
        slots = [(g, p) for p in range(a.procs_per_gpu) for g in range(k)]
        if a.artifact and a.procs_per_gpu > 1 and not os.path.exists(a.artifact):
            slots, self._deferred = [x for x in slots if x[1] == 0], [x for x in slots if x[1] > 0]
        return [self._worker(g, p) for g, p in slots]

    def _worker(self, g: int, slot: int) -> Worker:
        a = self.args
        common = ["--lanes", str(a.lanes), "--workers", str(a.workers), "--busy-window", str(a.busy_window),
                  "--branches", str(a.branches), *(["--blas-streams", str(a.blas_streams)] if a.blas_streams else []),
                  *(["--journal"] if a.journal else []),
                  *(["--full-lanes", str(a.full_lanes)] if a.full_lanes is not None else []),
                  *(["--artifact", a.artifact] if a.artifact else []),
                  *(["--share-weights-dir", self.share_dir(), "--share-weights-slots", str(a.procs_per_gpu)]
                    if a.share_weights else [])]  # check_share_weights: only with procs_per_gpu > 1
        env = worker_env(child_env(self.visible, g), self.connections)
        if self.mps is not None:
            env = self.mps.env(env)
        return Worker(g, [sys.executable, str(ENTRY), "--worker", str(g), "--slot", str(slot)] + common
                      + passthrough(a), env, slot=slot)

    def share_dir(self) -> str:
        """``--share-weights``: the run's own directory of publications (one per GPU, by slot 0)."""
        if self._share_dir is None:
            self._share_dir = tempfile.mkdtemp(prefix="cadence-weights-")
            self.meta["share_weights"] = dict(dir=self._share_dir)
        return self._share_dir

    def ready(self, workers: list[Worker]) -> list[dict]:
        """Every worker's ready line; workers deferred by :meth:`start_workers` start (into ``workers``)
        once the first ones are ready, and theirs follow."""
        ready = [dict(w.receive(), slot=w.slot) for w in workers]
        if self._deferred:
            later = [self._worker(g, p) for g, p in self._deferred]
            self._deferred = []
            workers.extend(later)
            ready += [dict(w.receive(), slot=w.slot) for w in later]
        if self.mps is not None:
            self.mps.note_clients()
        return ready

    def stop_mps(self) -> None:
        if self.mps is not None:
            self.mps.stop()

    def groups(self, workers: list[Worker], g: int, width: int) -> list[list[Worker]]:
        """The worker groups of one batch of ``g``-GPU rows: ``width`` disjoint groups of one worker per
        GPU (``--pack``), or, with ``--procs-per-gpu`` > 1, one group of every worker on the first ``g``
        GPUs, slot-major, so that worker ``j`` of it serves on GPU ``j % g`` (:meth:`_serve_cmd`)."""
        if self.args.procs_per_gpu > 1:
            return [sorted((w for w in workers if w.g < g), key=lambda w: (w.slot, w.g))]
        return [workers[j * g:(j + 1) * g] for j in range(width)]

    def _serve_cmd(self, n: int, parts: int, j: int, t0: float, chunks: int, busy_window: float,
                   draw_replay: str = "lock") -> dict:
        """What worker ``j`` of a group of ``parts`` workers serves of an N-session run: sessions
        ``j, j+parts, ...`` (on GPU ``i % g`` for session ``i``, as the group is slot-major)."""
        a = self.args
        return dict(cmd="serve", n=n, sessions=sessions_of(n, parts, j), t0=t0, period=a.period,
                    chunks=chunks, scripts=a.scripts, join_live=a.join_live, busy_window=busy_window, pin=a.pin,
                    draw_replay=draw_replay, cutoff_s=row_cutoff_s(a.period, chunks, a.row_slack),
                    busy_union=a.procs_per_gpu > 1)

    def warm(self, workers: list[Worker], gpus: list[int], sessions: dict[int, list[int]]) -> None:
        """Every worker, at once, serves an untimed ``--warm-seconds`` stream of its share of the first N it
        will serve (the first row of the first GPU count whose first batch uses it); nothing is a row."""
        a = self.args
        chunks = int(round(self.warm_s / a.period))
        if chunks <= 0:
            return
        first: dict[int, tuple[Worker, int, int, int, int]] = {}  # id(worker) -> (worker, n, g, j, parts)
        for g in gpus:
            if not sessions[g]:
                continue
            width = max(1, len(workers) // g) if a.pack else 1
            for grp in self.groups(workers, g, width):
                for j, w in enumerate(grp):
                    first.setdefault(id(w), (w, sessions[g][0], g, j, len(grp)))
        t_start = time.monotonic()
        t0 = time.time() + min(a.lead, 0.5)  # untimed: a late start only delays the warm stream
        for w, n, g, j, parts in first.values():
            w.send(self._serve_cmd(n, parts, j, t0, chunks, 0.0))
        per = []
        for w, n, g, j, parts in first.values():
            part = w.receive()
            lat = [latency_ms(r) for r in part["records"]]
            per.append(dict(gpu=w.g, slot=w.slot, n_sessions=n, gpus=g, sessions=len(part["sha"]), chunks=len(lat),
                            p50_ms=harness.percentile(lat, 50), p99_ms=harness.percentile(lat, 99),
                            misses=sum(missed(x, a.period) for x in lat), peak_mib=part["peak_mib"]))
        self.meta.setdefault("SRc", {})["warm"] = dict(seconds=self.warm_s, chunks_per_session=chunks,
                                                       wall_s=time.monotonic() - t_start, per_worker=per)
        print(f"warm stream: {self.warm_s:g} s at N=" + ",".join(f"{p['n_sessions']}(gpu {p['gpu']})" for p in per)
              + f" in {time.monotonic() - t_start:.1f} s (not a row)", file=sys.stderr, flush=True)

    def run_src(self, workers: list[Worker], gpus: list[int], sessions: dict[int, list[int]]) -> None:
        a = self.args
        ready = self.ready(workers)
        self.device = self.device or ready[0]["device"]
        self.check_solo_device()
        self.meta["SRc"] = dict(workers=ready)
        self.warm(workers, gpus, sessions)
        modes = draw_replay_modes(a.draw_replay)
        for g in gpus:
            todo = [(n, mode) for n in sessions[g] for mode in modes]
            width = max(1, len(workers) // g) if a.pack else 1  # --pack: the same N on disjoint GPU groups
            missed_modes: set[str] = set()
            while todo:
                (n0, mode), todo = todo[0], todo[1:]
                if mode in missed_modes:  # this mode missed at a smaller N: a larger one only misses more
                    continue
                batch = [n0] * width
                if self.over_budget("SRc", g, n0, row_cutoff_s(a.period, self.chunks, a.row_slack) + a.lead + 15):
                    break
                t0 = time.time() + a.lead
                groups = self.groups(workers, g, len(batch))
                samplers = [self._nvml([w.g for w in grp], t0) for grp in groups]
                for n, grp in zip(batch, groups):
                    for j, w in enumerate(grp):
                        w.send(self._serve_cmd(n, len(grp), j, t0, self.chunks, a.busy_window, mode))
                rows = []
                for rep_i, (n, grp, nvml) in enumerate(zip(batch, groups, samplers)):
                    parts = [w.receive() for w in grp]
                    nvml.stop_at = 0
                    row = merge_row("SRc", g, n, parts, self.solo, a.scripts, a.period, self.chunks)
                    row.update(nvml.result(), lanes=a.lanes, full_lanes=a.full_lanes, branches=a.branches,
                               blas_streams=a.blas_streams, cuda_connections=self.connections, join_live=a.join_live,
                               pin=a.pin, journal=a.journal, draw_replay=mode, procs_per_gpu=a.procs_per_gpu,
                               mps=bool(self.mps is not None and self.mps.running),
                               host=[p.get("host") for p in parts],
                               gpu_ids=sorted({w.g for w in grp}),
                               concurrent_n=batch[:rep_i] + batch[rep_i + 1:] if len(batch) > 1 else None,
                               repeat=rep_i if len(batch) > 1 else None,
                               per_session_mib=next((p["per_session_mib"] for p in parts if p["per_session_mib"]),
                                                    None),
                               late_start_s=max(p["late_start_s"] for p in parts),
                               counters=[p["counters"] for p in parts], census_mib=parts[0]["census_mib"])
                    rows.append(row)
                for row in rows:
                    self.add(row)
                if any(r["misses"] for r in rows) and not a.full_sweep:
                    missed_modes.add(mode)
                    if missed_modes >= set(modes):
                        break

    def _nvml(self, gpus: list[int], t0: float) -> NvmlSampler:
        """NVML samples of the given GPUs (worker indices) from a second after t0, until stopped."""
        s = NvmlSampler([self.visible[g] for g in gpus] if self.visible else [])
        s.start_at = t0 + 1.0
        if self.visible:
            s.start()
        return s

    # ------------------------------------------------------------------ stock
    def run_stock(self, gpus: list[int], sessions: dict[int, list[int]]) -> None:
        """Each GPU count's N in turn, each row on its own N stock processes: a process left idle on the
        GPU beside a row slows it (docs/benchmarks.md, session 14), so no row runs beside idle ones."""
        a = self.args
        for g in gpus:
            for n in sessions[g]:
                if self.over_budget("stock", g, n, a.seconds + a.lead + 45):
                    break
                procs = StockRow(self, g, n)
                try:
                    error = procs.wait_ready()
                    self.meta.setdefault("stock", []).append(procs.facts())
                    row = (dict(cell="stock", name="stock", gpus=g, n_sessions=n, error=error) if error
                           else self._stock_n(procs))
                finally:
                    procs.close()
                self.add(row)
                if "error" in row or (row["misses"] and not a.full_sweep):
                    break

    def _stock_n(self, procs: StockRow) -> dict:
        a = self.args
        g, n = procs.g, procs.n
        t0 = time.time() + a.lead
        nvml = self._nvml(list(range(g)), t0)
        results = procs.serve(t0)
        nvml.stop_at = 0
        if isinstance(results, str):
            return dict(cell="stock", name="stock", gpus=g, n_sessions=n, error=results)
        self.device = self.device or results[0]["device"]
        self.check_solo_device()
        parts = []
        for gi in range(g):
            mine = [(i, r) for i, r in enumerate(results) if i % g == gi]
            parts.append(dict(gpu=gi, records=[rec for _i, r in mine for rec in r["records"]],
                              sha={str(i): r["sha"] for i, r in mine}, joins=[],
                              peak_mib=sum(r["peak_mib"] or 0 for _i, r in mine) if self.visible else None))
        row = merge_row("stock", g, n, parts, self.solo, a.scripts, a.period, self.chunks)
        row.update(nvml.result(), per_session_peak_mib=max((r["peak_mib"] or 0) for r in results) or None,
                   script_sha=script_sha(results, a.scripts), threads_per_process=procs.threads)
        return row
