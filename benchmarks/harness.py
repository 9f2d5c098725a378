"""The benchmark harness: every benchmark runs, times, gates and reports its cells through this module.

A benchmark is a script with a set of named cells (``B0``, the unmodified program, is the baseline).
The driver half of the script hands its cells to :func:`run_cells`, which runs each one in a **fresh
process** (``script --one CELL --out FILE --lane L [--block B] ...``); the cell half builds, times
and hashes one cell and writes its rows with :func:`write_cell`. Lanes run queues of cells side by
side, one GPU each. Rows are plain dicts (``name``, ``block``, ``lane``, ``p50_ms``, ``p95_ms``,
``peak_mib``, ``sha256``, ... or ``error``), saved as JSON lines as each cell finishes and merged
back with :func:`read_rows`.

The exactness gate (:func:`gate`): a cell whose output bytes (SHA-256) differ from those of the
baseline cell of the same run, lane and block is NOT EXACT and is never credited with a speedup.

Percentiles are nearest-rank (ties round up): every reported figure is the latency of a call that
happened, never an interpolation between two calls, and p50 of an even count is the upper median.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from cadence_fx.determinism import sha256_tensors

__all__ = [
    "StreamResult", "add_flags", "append_rows", "baselines_agree", "collect", "count_launches", "gate", "lanes_of",
    "peak_mib", "percentile", "profile_calls", "profile_events", "read_rows", "run_cells", "summarize", "sync", "table", "time_stream",
    "timed", "write_cell", "write_json",
]

BASELINE = "B0"
_LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


# --------------------------------------------------------------------------- timing
def sync() -> None:
    """Wait for the device (a no-op without CUDA): a timing ends when the work has, not when it was queued."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` timed to completion on the device: (its output, milliseconds)."""
    sync()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile of ``xs``, nearest rank with ties rounded up (nan for no values)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, math.floor(q / 100 * (len(s) - 1) + 0.5))]


@dataclass
class StreamResult:
    """Per-call latencies (ms), the SHA-256 of everything the stream emitted, and peak memory."""

    ms: list[float] = field(default_factory=list)
    sha256: str = ""
    peak_mib: float | None = None
    launches_per_call: float | None = None
    kernels_per_call: float | None = None

    def p(self, q: float) -> float:
        return percentile(self.ms, q)

    @property
    def p50(self) -> float:
        return self.p(50)

    @property
    def p95(self) -> float:
        return self.p(95)


def time_stream(step: Callable[[int], Any], calls: int, *, emitted: Callable[[Any], Sequence[torch.Tensor]]
                ) -> StreamResult:
    """Run ``step(k)`` for k in range(calls), timing each call to completion and hashing what it emits."""
    res = StreamResult()
    out_bytes: list[torch.Tensor] = []
    for k in range(calls):
        out, ms = timed(step, k)
        res.ms.append(ms)
        out_bytes.extend(t.detach().clone() for t in emitted(out))
    res.sha256 = sha256_tensors(out_bytes)
    return res


def count_launches(fn: Callable[[], Any], *, calls: int = 1) -> tuple[float, float]:
    """(host launch API calls, device kernels) per call of ``fn``, read with the torch profiler."""
    p = profile_calls(fn, calls=calls)
    return p["launches"], p["kernels"]


GAP_FIELDS = ("span_ms", "short_gaps_ms", "host_gaps_ms", "lead_ms")  # see profile_calls
_HOST_GAP_US = 5.0  # an idle stretch on the device this long is waiting for the host, not a node switch


def profile_calls(fn: Callable[[], Any], *, calls: int = 1) -> dict[str, float]:
    """Per call of ``fn``: host launch API calls, device kernels, and device busy time (the sum of
    kernel durations, ms: the floor a launch-free schedule of the same kernels could reach). nan
    without CUDA.

    Where the time between busy and the wall goes: ``span_ms`` (first device activity to last, copies
    included), the idle time inside it split at ``_HOST_GAP_US`` into ``short_gaps_ms`` (the device
    going from one kernel to the next: the per-node cost of a graph or a launch queue that is ahead)
    and ``host_gaps_ms`` (the device waiting for the host), and ``lead_ms`` (the call's start to the
    first device activity: host work before anything is queued)."""
    nan = float("nan")
    if not torch.cuda.is_available():
        return {"launches": nan, "kernels": nan, "busy_ms": nan}
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    ev = profile_events(prof)
    out = {"launches": ev["launches"] / calls, "kernels": sum(ev["kernel_names"].values()) / calls,
           "busy_ms": ev["busy_ms"] / calls}
    if ev["device"]:
        out.update({k: v / calls for k, v in device_gaps(ev["device"], ev["host_start"]).items()})
    return out


def profile_events(prof: Any, *, range_prefix: str | None = None) -> dict[str, Any]:
    """One walk over a finished ``torch.profiler`` run: host launch API calls (``launches``), kernels by
    whole name (``kernel_names``; copies and memsets are not kernels), their summed durations
    (``busy_ms``), every device interval, copies included (``device``, for :func:`device_gaps`), the
    first host event (``host_start``), and the host ranges of ``record_function`` blocks whose name
    starts with ``range_prefix`` (``ranges``, keyed by the rest of the name; their device-side mirrors are
    not device work)."""
    launches = 0
    busy_us = 0.0
    names: Counter = Counter()
    device: list[tuple[float, float]] = []
    ranges: dict[str, tuple[float, float]] = {}
    host_start = None
    for ev in prof.events():
        if ev.name in _LAUNCH_APIS:
            launches += 1
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            # a record_function range is mirrored on the device timeline as an annotation spanning its
            # work: not work itself (counted, it would fill every gap and double the busy time)
            if getattr(ev, "is_user_annotation", False) or (range_prefix is not None and ev.name.startswith(range_prefix)):
                continue
            device.append((ev.time_range.start, ev.time_range.end))
            if "Memcpy" not in ev.name and "Memset" not in ev.name:
                names[ev.name] += 1
                busy_us += ev.time_range.elapsed_us()
            continue
        if host_start is None or ev.time_range.start < host_start:
            host_start = ev.time_range.start
        if range_prefix is not None and ev.name.startswith(range_prefix):
            ranges[ev.name[len(range_prefix):]] = (ev.time_range.start, ev.time_range.end)
    return {"launches": launches, "kernel_names": names, "busy_ms": busy_us / 1e3, "device": device,
            "host_start": host_start, "ranges": ranges}


def device_gaps(device: Sequence[tuple[float, float]], host_start: float | None = None) -> dict[str, float]:
    """Split the device timeline of ``device`` (``(start, end)`` µs of every kernel and copy, overlaps
    allowed) into ``span_ms``, ``short_gaps_ms`` (idle stretches under ``_HOST_GAP_US``),
    ``host_gaps_ms`` (longer ones) and ``lead_ms`` (``host_start`` to the first activity; nan without it)."""
    ivs = sorted(device)
    short = host = 0.0
    end = ivs[0][1]
    for s, e in ivs[1:]:
        if s > end:
            gap = s - end
            if gap < _HOST_GAP_US:
                short += gap
            else:
                host += gap
        end = max(end, e)
    lead = ivs[0][0] - host_start if host_start is not None else float("nan")
    return {"span_ms": (end - ivs[0][0]) / 1e3, "short_gaps_ms": short / 1e3, "host_gaps_ms": host / 1e3,
            "lead_ms": lead / 1e3}


def release_library_workspaces() -> None:
    """Free the cuBLAS workspaces cached per stream, before a cell is ready (nothing is captured yet, so no
    graph holds one). An optimized cell exports in its own process, and the export's eager run leaves a
    workspace on the default stream that its replays never use; a server loading a saved program
    (``cf.load``) never makes it. The stock cells hold none at this point, so for them it is a no-op."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        clear()


def branch_summary(progs: Any) -> dict[str, int] | None:
    """How much of the replayed graphs of ``progs`` (optimized programs) left the capture stream:
    graphs, kernels, moved kernels, fences and streams over every engine with a parallel-branch plan;
    ``None`` where no graph has one (one stream)."""
    plans = [e.branch_plan for p in progs for e in p.runners().values() if getattr(e, "branch_plan", None) is not None]
    if not plans:
        return None
    return dict(graphs=len(plans), kernels=sum(p.kernels for p in plans), moved=sum(p.moved for p in plans),
                fences=sum(p.fences for p in plans), streams=max(p.streams for p in plans))


def library_warnings(limit: int = 20, width: int = 600) -> list[str]:
    """Start keeping the warnings ``cadence_fx`` logs in this process (a capture refused, with its error;
    a class invalidated); returns the list they are appended to (the first ``limit``, each cut to
    ``width`` characters), for the cell's row: a cell's process is gone when the report is printed."""
    kept: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if len(kept) < limit:
                kept.append(record.getMessage()[:width])

    logger = logging.getLogger("cadence_fx")
    logger.addHandler(_Keep(level=logging.WARNING))
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    return kept


def record_memory() -> None:
    """Start recording device allocations with their Python stacks (read by :func:`write_memory_peak`)."""
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")


def write_memory_peak(path: str, name: str, top: int = 30) -> None:
    """What the allocations made since recording began (warm-up and the first block) held at their
    highest: the trace replayed event by event, the live set at the maximum grouped by where it was
    allocated (the innermost frames of this project and of the model)."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    live: dict[int, tuple[int, list]] = {}
    now = best = 0
    best_live: dict[int, tuple[int, list]] = {}
    at: list = []
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            now += ev["size"]
            if now > best:
                best, best_live, at = now, dict(live), ev.get("frames", [])
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])[0]
    _write_groups(path, f"== {name}: peak of the recorded allocations {best / 2**20:.3f} MiB above the start "
                        f"({best} bytes), {len(best_live)} blocks ({len(trace)} events); "
                        f"max_memory_allocated {torch.cuda.max_memory_allocated()} bytes; reached at "
                        f"{_stack_where(at)}", best_live.values(), top, precision=3)
    _write_blocks(path, name, "peak", best_live.values())


def write_memory_live(path: str, name: str, top: int = 40) -> None:
    """Every block live now, grouped by where it was allocated (recording must have begun before the
    allocations of interest: blocks allocated before it carry no stack). Recording stays on."""
    snap = torch.cuda.memory._snapshot()
    dev = torch.cuda.current_device()
    blocks = [(b["size"], b.get("frames", [])) for seg in snap["segments"] if seg["device"] == dev
              for b in seg["blocks"] if b["state"] == "active_allocated"]
    total = sum(size for size, _ in blocks)
    _write_groups(path, f"== {name}: live {total / 2**20:.3f} MiB in {len(blocks)} blocks "
                        f"(allocated {torch.cuda.memory_allocated()} bytes)", blocks, top, precision=3)
    _write_blocks(path, name, "live", blocks)


def _stack_where(frames: list) -> str:
    """The innermost frames of this project and of the model, outermost last."""
    return " <- ".join(f"{fr['filename'].split('/')[-1]}:{fr['line']}:{fr['name']}" for fr in frames
                       if fr["filename"].endswith(".py") and "torch/" not in fr["filename"])


def _write_blocks(path: str, name: str, what: str, blocks) -> None:
    """Every block (bytes, where) as one JSON line next to ``path``, so two cells can be diffed exactly."""
    with open(str(path) + ".jsonl", "a") as f:
        f.write(json.dumps({"cell": name, "what": what, "blocks": [[size, _stack_where(fr)[:400]] for size, fr in blocks]})
                + "\n")


def _write_groups(path: str, title: str, blocks, top: int, precision: int = 1) -> None:
    """Append ``title`` and the blocks (size, frames) grouped by the innermost frames of this project
    and of the model, largest first."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in blocks:
        where = _stack_where(frames)
        groups[where[:400]][0] += size
        groups[where[:400]][1] += 1
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(title + "\n")
        for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
            f.write(f"{size / 2**20:{9 + precision}.{precision}f} MiB {n:5d} blocks  {where or '(no stack)'}\n")


def peak_mib(reset: bool = False) -> float | None:
    """The caching allocator's peak allocation since the last reset, MiB (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    sync()
    value = torch.cuda.max_memory_allocated() / 2**20
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return value


# --------------------------------------------------------------------------- cells, one fresh process each
def add_flags(ap: argparse.ArgumentParser, *, cells: str, blocks: int) -> None:
    """The flags every benchmark driver shares, and the hidden ones of the cell protocol."""
    ap.add_argument("--cells", default=cells, help="cells in order; with --lanes, lanes separated by '/' "
                                                   "(e.g. B0,SRc/B0,S)")
    ap.add_argument("--blocks", type=int, default=blocks)
    ap.add_argument("--lanes", type=int, default=1, help="run lanes of cells side by side, one GPU each")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default=None, help="also append every cell's raw rows to this file (JSON lines)")
    ap.add_argument("--merge", nargs="*", default=None,
                    help="report saved rows instead of running (JSON lines, or a --json file); each file is a run")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--block", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lane", type=int, default=0, help=argparse.SUPPRESS)


def lanes_of(cells: str, lanes: int) -> list[list[str]]:
    """``--cells`` split into ``lanes`` queues ('/' between lanes, ',' between cells)."""
    out = [[c for c in lane.split(",") if c] for lane in cells.split("/")]
    if len(out) != lanes:
        raise SystemExit(f"--cells {cells!r} has {len(out)} lane(s) ('/'-separated) but --lanes is {lanes}")
    return out


def write_cell(out: str | Path, rows: dict | list[dict]) -> None:
    """The cell half of the protocol: write this process's row (or one row per block) for the driver."""
    Path(out).write_text(json.dumps(rows))


def run_cells(script: str | Path, lanes: Sequence[Sequence[str]], args: Sequence[str] = (), *,
              blocks: int | None = None, rows_path: str | Path | None = None) -> list[dict]:
    """Run every cell in a fresh process: ``python script --one CELL --out FILE --lane L [--block B] *args``.

    ``blocks``: one process per (block, cell), each writing one row; ``None``: one process per cell,
    which streams every block itself and writes one row per block. Lanes run side by side (one thread
    each), cells of a lane one after the other; with more than one lane, lane L sees only GPU L
    (``CUDA_VISIBLE_DEVICES``). A cell that fails leaves a row with ``error`` (the end of its output).
    Each cell's rows are appended to ``rows_path`` as soon as it finishes, so a run cut short keeps what
    it measured. Returns the rows in the order the cells finished.
    """
    rows: list[dict] = []
    lock = threading.Lock()

    def run_lane(lane: int, cells: Sequence[str]) -> None:
        env = dict(os.environ)
        if len(lanes) > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(lane)
        for block in (range(blocks) if blocks is not None else [None]):
            for cell in cells:
                new, stderr = _run_one(script, cell, lane, block, args, env)
                with lock:
                    relay = "".join(line + "\n" for line in stderr.splitlines() if "Error" in line)[-3000:]
                    sys.stderr.write(relay)
                    for r in new:
                        print(_progress(r), file=sys.stderr, flush=True)
                    rows.extend(new)
                    if rows_path:
                        append_rows(rows_path, new)

    threads = [threading.Thread(target=run_lane, args=(i, cells)) for i, cells in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def _run_one(script, cell: str, lane: int, block: int | None, args: Sequence[str], env: dict) -> tuple[list[dict], str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(script), "--one", cell, "--out", str(out), "--lane", str(lane)]
        cmd += (["--block", str(block)] if block is not None else []) + list(args)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0  # the whole process: import, build, export, optimize, stream
        if proc.returncode != 0 or not out.exists():
            return [dict(name=cell, block=block or 0, lane=lane, process_s=wall,
                         error=(proc.stdout + proc.stderr)[-3000:])], ""
        got = json.loads(out.read_text())
    new = got if isinstance(got, list) else [got]
    for r in new:
        r["process_s"] = wall
        if block is not None:
            r["block"] = block
        r.setdefault("block", 0)
        r.setdefault("lane", lane)
    return new, proc.stderr


def _progress(r: dict) -> str:
    where = f"[{r['name']} lane {r.get('lane', 0)} block {r.get('block', 0)}]"
    took = f" (process {r['process_s']:.0f} s)" if r.get("process_s") is not None and r.get("block", 0) == 0 else ""
    if "error" in r:
        return f"{where} FAILED{took}\n{r['error']}"
    peak = f"{r['peak_mib']:.0f} MiB" if r.get("peak_mib") is not None else "n/a"
    return (f"{where} p50 {r['p50_ms']:.2f} ms, p95 {r['p95_ms']:.2f} ms, peak {peak}, sha {r['sha256'][:12]}"
            + (f", {r['notes']}" if r.get("notes") else "") + took)


def collect(args: argparse.Namespace, script: str | Path, common: Sequence[str], *, per_block: bool) -> list[dict]:
    """The driver: the gated rows of ``--merge`` files, or of a fresh run of ``--cells`` in ``--lanes``
    (``per_block``: one process per (block, cell); otherwise one per cell, ``common`` carrying
    ``--blocks``)."""
    if args.merge is not None:
        return gate(read_rows(args.merge))
    lanes = lanes_of(args.cells, args.lanes)
    return gate(run_cells(script, lanes, common, blocks=args.blocks if per_block else None, rows_path=args.rows))


# --------------------------------------------------------------------------- rows
def append_rows(path: str | Path, rows: Iterable[dict]) -> None:
    """Append raw rows to a JSON lines file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def read_rows(paths: Iterable[str | Path]) -> list[dict]:
    """Rows saved by earlier runs, each file a run of its own (``run`` 0, 1, ...): JSON lines of raw rows,
    a JSON list of rows, or a ``--json`` report (its ``cells``; runs already merged in it stay apart).
    Rows of separate runs are gated against their own run's baseline."""
    rows: list[dict] = []
    run = 0
    for path in paths:
        text = Path(path).read_text()
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = [json.loads(line) for line in text.splitlines() if line.strip()]
        if isinstance(doc, dict):
            doc = doc.get("cells", [doc])
        runs = {k: run + i for i, k in enumerate(dict.fromkeys(r.get("run", 0) for r in doc))}
        rows += [dict(r, run=runs[r.get("run", 0)]) for r in doc]
        run += max(len(runs), 1)
    return rows


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1))


# --------------------------------------------------------------------------- the exactness gate
def _where(r: dict) -> tuple:
    return r.get("run", 0), r.get("lane", 0), r.get("block", 0)


def gate(rows: Iterable[dict], baseline: str = BASELINE) -> list[dict]:
    """The cell rows (those with timings or an error), each marked ``bitexact`` against the baseline of
    its run, lane and block (any baseline of the block where its lane ran none) and credited a
    ``speedup`` (baseline p50 / cell p50) only when exact; the baseline's own speedup is 1.0."""
    cells = [r for r in rows if "p50_ms" in r or "error" in r]
    bases = {r.get("baseline", baseline) for r in cells} | {baseline}
    base = {(r["name"], *_where(r)): r for r in cells if r["name"] in bases and "error" not in r}
    for r in cells:
        own = r.get("baseline", baseline)  # a cell of another dtype path is gated against that path's stock cell
        run, lane, block = _where(r)
        b = base.get((own, run, lane, block)) or next(  # the same run's other lane first, then any run's
            (v for (n, rn, _l, blk), v in sorted(base.items(), key=lambda kv: kv[0][1] != run)
             if n == own and blk == block), None)
        # no baseline in the run (a cell run alone): not judged here, neither exact nor NOT EXACT
        r["bitexact"] = None if b is None and "error" not in r else "error" not in r and r["sha256"] == b["sha256"]
        r["speedup"] = (1.0 if r["name"] == own and "error" not in r
                        else b["p50_ms"] / r["p50_ms"] if r["bitexact"] else None)
    return cells


def baselines_agree(rows: Iterable[dict], baseline: str = BASELINE) -> bool:
    """Whether every baseline row of a block (over lanes and runs) produced the same bytes."""
    base = {_where(r): r["sha256"] for r in rows if r["name"] == baseline and "error" not in r}
    return len({(blk, sha) for (_r, _l, blk), sha in base.items()}) == len({blk for _r, _l, blk in base})


def summarize(rows: Sequence[dict], baseline: str = BASELINE) -> dict[str, dict]:
    """One entry per cell and run (a cell measured in two runs stays two entries, ``NAME (run K)``):
    the median over its blocks' p50, its peak, and a speedup against the baseline of the same run only
    where every block is bit-exact. Takes gated rows."""
    runs_of: dict[str, set] = {}
    for r in rows:
        runs_of.setdefault(r["name"], set()).add(r.get("run", 0))
    summary: dict[str, dict] = {}
    base_of: dict[tuple[str, int], dict] = {}  # (baseline cell, run) -> its summary
    # baseline cells first, so a cell listed before its run's baseline still gets its speedup
    order = list(dict.fromkeys((r["name"], r.get("run", 0)) for r in rows))  # the report keeps this order
    bases = {r.get("baseline", baseline) for r in rows} | {baseline}
    labels: dict[tuple[str, int], str] = {}
    for name, run in sorted(order, key=lambda k: k[0] not in bases):
        key = labels[(name, run)] = name if len(runs_of[name]) == 1 else f"{name} (run {run})"
        rs = [r for r in rows if r["name"] == name and r.get("run", 0) == run and "error" not in r]
        if not rs:
            summary[key] = dict(error=True)
            continue
        exact = all(r["bitexact"] for r in rs)
        p50 = percentile((r["p50_ms"] for r in rs), 50)
        s = dict(run=run, p50_ms=p50, peak_mib=max((r.get("peak_mib") or 0) for r in rs),
                 warmup_s=rs[0].get("warmup_s"), bitexact_blocks=f"{sum(bool(r['bitexact']) for r in rs)}/{len(rs)}"
                 + (" (no baseline run)" if any(r["bitexact"] is None for r in rs) else ""))
        prof = next((r for r in rs if r.get("busy_ms") == r.get("busy_ms") and r.get("busy_ms") is not None), None)
        if prof:  # the floor a launch-free schedule of the same kernels reaches, and how far the cell is from it
            s.update(busy_ms=prof["busy_ms"], p50_over_busy=p50 / prof["busy_ms"] if prof["busy_ms"] else None,
                     kernels_per_chunk=prof.get("kernels_per_chunk"),
                     **{k: prof[k] for k in GAP_FIELDS if prof.get(k) is not None})
        own = rs[0].get("baseline", baseline)
        if own != baseline:
            s["baseline"] = own
        if name == own:  # a baseline cell (B0, or the stock cell of another path)
            base_of[(name, run)] = s
        b = base_of.get((own, run), {})
        s["speedup"] = b["p50_ms"] / p50 if exact and name != own and b else None
        b0 = base_of.get((baseline, run), {})
        if b0.get("peak_mib") and s["peak_mib"]:
            s["peak_vs_B0"] = s["peak_mib"] / b0["peak_mib"] - 1
        summary[key] = s
    return {label: summary[label] for label in (labels[k] for k in order)}


# --------------------------------------------------------------------------- the table
def fmt_number(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and v == v else "n/a"


def table(rows: Sequence[dict]) -> str:
    """One line per row; ``run`` and ``lane`` columns appear when the rows have more than one."""
    show_run = len({r.get("run", 0) for r in rows}) > 1
    show_lane = len({r.get("lane", 0) for r in rows}) > 1
    where = (f"{'run':>4}" if show_run else "") + (f"{'lane':>5}" if show_lane else "")
    head = (f"{'cell':<12}{where}{'block':>6}{'p50 ms':>10}{'p95 ms':>10}{'peak MiB':>10}{'kernels':>9}{'launches':>9}"
            f"{'busy ms':>9}{'warmup s':>9}{'exact':>7}{'speedup':>10}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        at = (f"{r.get('run', 0):>4}" if show_run else "") + (f"{r.get('lane', '?')!s:>5}" if show_lane else "")
        if "error" in r:
            last = (r["error"].strip().splitlines() or ["?"])[-1][:80]
            lines.append(f"{r['name']:<12}{at}{r.get('block', 0):>6}  failed: {last}")
            continue
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else \
            ("-" if r.get("bitexact") else "no B0" if r.get("bitexact") is None else "NOT EXACT")
        lines.append(f"{r['name']:<12}{at}{r.get('block', 0):>6}{r['p50_ms']:>10.2f}{r['p95_ms']:>10.2f}"
                     f"{fmt_number(r.get('peak_mib'), '.0f'):>10}{fmt_number(r.get('kernels_per_chunk'), '.0f'):>9}"
                     f"{fmt_number(r.get('launches_per_chunk'), '.0f'):>9}{fmt_number(r.get('busy_ms'), '.1f'):>9}"
                     f"{r.get('warmup_s', 0):>9.2f}{str(r.get('bitexact')):>7}{sp:>10}  {r.get('notes', '')}")
    return "\n".join(lines)
