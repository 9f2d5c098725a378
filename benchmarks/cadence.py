"""Conversations per GPU at a real-time cadence: N Token2Wav sessions, one 1 s chunk per second each.

    python benchmarks/cadence.py --cells SRc,stock --gpus 1 --sessions 38,40 --stock-sessions 12,14 \\
        --lanes 8 --warm-seconds 5 --json docs/results/cadence-h200.json

Released dimensions, random weights, fp32 (``--dtype float16``: the float16 path of the Token2Wav
build, where this checkout has one), the 0.1.2 driver (flow chunk + trim + stochastic HiFT). Each
session is one conversation: chunk k of session i (of N) arrives at ``t0 + i/N + k`` seconds, and is
late when its PCM is not on the host one second after it arrived (a playback underrun: a deadline
miss). Latency is arrival to PCM ready, so it includes queueing. ``--seconds`` (default 60) is the
length of every conversation, so every N runs that long.

GPUs (``--gpus``, a list: default every visible GPU, or 1 without CUDA). For ``g`` GPUs, session i
is placed on GPU ``i % g`` (round robin; the global stagger makes each GPU's arrivals ``g/N`` s
apart). Every process that serves sessions sees one GPU (``CUDA_VISIBLE_DEVICES``); all of them
start a run at one wall-clock ``t0`` chosen by the coordinator (this process, which never touches a
GPU), so every arrival is on the same 1 s grid, and the coordinator merges their per-chunk latencies
into one row per (cell, gpus, N). ``--sessions`` takes one list of N per entry of ``--gpus``,
separated by '/' (``16,17,18/32,34,36``), or one list: the N of the first GPU count, scaled for the
others. Each list is
swept upward and stops at the first N with misses (``--full-sweep``: keep going); the report's
``limits`` give, per cell and GPU count, the largest N without a miss and the ratio of the largest
GPU count's limit to one GPU's.

Cells, in one run:

- ``SRc``: one optimized program (chunk clock, one graph per solver step) with ``--lanes`` lanes per
  GPU; worker threads (one per lane) serve the due chunks earliest first. One long-lived worker
  process per GPU builds the model from the benchmark seed (so every GPU holds the same weights),
  exports the catalog and optimizes it once, in parallel with the others, then serves one N after
  another. Before its first measured row every worker serves an untimed warm stream of
  ``--warm-seconds`` (default 10 s on GPUs, 0: none) at the first N it will serve (its share of that
  row's sessions, joined as that row joins them), so the allocator's growth to that many sessions,
  lazy cuBLAS/cuDNN set-up and first replays fall in no measured row; the report keeps it as
  ``warm_s`` and ``setup.SRc.warm``, not as a row. ``--pack`` runs rows that need fewer GPUs than
  there are side by side on disjoint GPUs, and only rows of the same N (with ``--gpus 1,2``: N=16 on
  GPU 0 and N=16 on GPU 1, two independent one-GPU rows, a repeat; ``repeat`` numbers them and
  ``concurrent_n`` names the neighbours' N). Rows of different N are never packed, so a row never
  shares the host with a larger, overloaded one (session 5 packed N=16 beside N=17 and neither row was
  credible). Each row still has its GPUs to itself; the host's CPUs are shared, as they are in the
  two-GPU rows. An N counts as clean in ``limits`` only when every repeat of it is.
- ``stock``: the stock driver as it ships serves one conversation per model instance: one process per
  session, pinned to GPUs round robin (threads would share one default generator, so HiFT's draws,
  and the bytes, would depend on the neighbours; processes also escape the GIL, which the host-bound
  stock step needs). Each row has processes of its own, one per session, built when the row comes
  (:class:`StockRow`): a stock process left idle on the GPU slowed the rows beside it, though it
  submits nothing. Each process gets ``cpu_count // N`` intra-op threads: N processes with a thread
  per core each would oversubscribe the host N times.

Exactness: sessions follow ``--scripts`` conversation scripts (token stream and random seed). Before
any cell, one process per GPU runs its share of the scripts alone through the stock code (the solo
runs, in parallel with the SRc workers' builds); every session's PCM stream, in every cell, must
equal its script's solo run bit for bit (``bitexact``). Sessions of one script run at different times
beside different neighbours (and, with more than one GPU, on another GPU than the solo run), so equal
bytes also show the isolation.

Per row: p50/p95/p99 latency, misses, peak memory (``torch.cuda.max_memory_allocated`` of every
serving process, summed over GPUs; per GPU in ``per_gpu``), GPU busy fraction, and the cost of a join.

- GPU busy fraction (``busy_fraction``, SRc): in each worker process a ``torch.profiler`` window
  (CUDA activity only, so no host-side op recording) of ``--busy-window`` seconds (default 1), ending
  at the last arrival (every second of arrivals brings one chunk of every session, the last one
  too). The kernel intervals it records, on every lane's stream, are clipped to the window and
  merged (their union, not their sum: lanes overlap), then divided by the window. Memcpy and memset
  are not kernels and are not counted. The row gives the mean over GPUs and ``busy_per_gpu``. The
  profiler is stopped only after the run (stopping parses the trace with the GIL held, which would
  stall the serving threads), so CUPTI is on from the window's start until the last chunk is
  served; ``misses_while_profiling`` counts the misses among the chunks ready after the window
  opened (where tracing could have caused one).
  ``--busy-window 0`` turns it off.
- ``nvml_util`` (both cells, where pynvml is importable): NVML's utilization ("percent of time over
  the past sample period during which one or more kernels was executing"), sampled every 0.5 s by the
  coordinator over the run, mean over samples and GPUs; device-wide, so it covers the stock cell's
  many processes too.
- Joins: with ``--join-live`` each session joins when its first chunk arrives, during the others'
  traffic; ``join_p50_ms``/``join_max_ms`` are the cost of those joins (``prog.session``), and
  ``join_window_misses`` counts the other sessions' chunks on the same GPU that were pending at a
  join or arrived in the second after it (arrival in ``(t_join - 1 s, t_join + 1 s]``) and missed.
  Without it, sessions join before the traffic and the join cost is the mean of those joins.

``--model demo`` swaps Token2Wav for the small demo decoder (``cadence_fx.demo_model``), with
``--period`` shorter than 1 s: the CPU smoke test of the multi-process path, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.token2wav import EXPORT_SEED, build_step, pick_device, release_unreferenced  # noqa: E402
from cadence_fx.determinism import pin_envelope, sha256_tensors  # noqa: E402

T_START = time.monotonic()


# --------------------------------------------------------------------------- models
@dataclass
class Bench:
    """What the benchmark needs of a model: the stock step, its initial state, and its catalog."""

    step: Any  # StreamingStep: inputs, fresh, next_args, carry, driver_call
    spk: Any
    state0: dict
    contract: Any  # the contract the program is optimized for
    export: Callable[[], list]  # the catalog, exported from the stock step


def dtype_hook(dtype: str) -> dict:
    """The keyword arguments that ask ``benchmarks.token2wav.build_step`` for ``dtype``; SystemExit with
    the reason where this checkout's build has no such path."""
    if dtype == "float32":
        return {}
    params = inspect.signature(build_step).parameters
    if "dtype" in params:
        return {"dtype": getattr(torch, dtype)}
    if dtype == "float16" and "float16" in params:
        return {"float16": True}
    raise SystemExit(f"--dtype {dtype}: benchmarks/token2wav.py build_step{inspect.signature(build_step)} takes no "
                     f"'dtype' or 'float16' argument: this checkout has no {dtype} Token2Wav path")


def build_bench(args, device: str) -> Bench:
    if args.model == "demo":
        return _demo_bench(device)
    t2w, cfg, step, (tokens, mel, spk) = build_step(args, device, **dtype_hook(args.dtype))
    state0 = step.setup(tokens, mel, spk)

    def export():
        # the "step" routing installs both the CFM-loop and the estimator proxies: one export serves both clocks
        return t2w.export_step_catalog(step, state0, step.fresh(3, spk, seed=EXPORT_SEED),
                                       t2w.token2wav_contract(cfg, "step", driver="0.1.2"), granularity="step")

    contract = t2w.token2wav_contract(cfg, "chunk", driver="0.1.2", step_segments=True)
    return Bench(step, spk, state0, contract, export)


def _demo_bench(device: str) -> Bench:
    from cadence_fx.adapters.streaming import StreamingStep
    from cadence_fx.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

    class DemoStep(StreamingStep):
        """The demo decoder as a streaming step (noise is a per-chunk input: the stream draws nothing)."""

        inputs = ("tokens", "enc_kv", "est_kv", "conv", "noise")
        state = {"enc_kv": 1, "est_kv": 2, "conv": 3}

        def __init__(self, cfg: DemoConfig) -> None:
            super().__init__()
            self.cfg = cfg
            self.model = StreamingDecoder(cfg).eval()

        def forward(self, *args):
            return self.model(*args)

        driver_call = forward

        def fresh(self, n: int, spk, *, seed: int = 0) -> list[dict]:
            g = torch.Generator().manual_seed(seed)
            shape = (1, self.cfg.chunk, self.cfg.dim)
            return [{"tokens": torch.randn(*shape, generator=g).to(device),
                     "noise": torch.randn(*shape, generator=g).to(device)} for _ in range(n)]

    cfg = DemoConfig()
    torch.manual_seed(0)
    step = DemoStep(cfg).to(device)
    state0 = dict(zip(("enc_kv", "est_kv", "conv"), step.model.initial_state(device=device)))
    contract = demo_contract(cfg)
    return Bench(step, None, state0, contract, lambda: export_catalog(step.model, contract, device=device))


def _script_tokens(bench: Bench, script: int, chunks: int):
    return bench.step.fresh(chunks, bench.spk, seed=10_000 + script)


def _solo_stock(bench: Bench, script: int, chunks: int) -> str:
    """A script's conversation alone through the stock code: the bytes every session of it must give."""
    step = bench.step
    torch.manual_seed(script)
    st = {k: v.to(v.device, copy=True) for k, v in bench.state0.items()}
    pcm = []
    for f in _script_tokens(bench, script, chunks):
        with torch.no_grad():
            out = step.driver_call(*step.next_args(f, st))
        pcm.append(out[0].cpu())
        st = step.carry(out)
    return sha256_tensors(pcm)


def _child_setup() -> str:
    """Every process that builds a model: the same envelope and, on the CPU, one thread (the same
    reduction order in every process, and no oversubscription when the processes share a host)."""
    pin_envelope()
    device = pick_device()
    if device == "cpu":
        torch.set_num_threads(1)
    return device


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# --------------------------------------------------------------------------- GPU busy time
def union_length(intervals) -> int:
    """Total length covered by the half-open ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def busy_fraction(intervals_ns, window_ns: int, clip: tuple[int, int] | None = None) -> float | None:
    """Union of kernel intervals over the window. ``clip``: count only what lies in ``[start, end)``
    (the window, on the kernels' clock); without it the denominator is the window or the kernels'
    span, whichever is longer."""
    if window_ns <= 0:
        return None
    if clip is not None:
        lo, hi = clip
        intervals_ns = [(max(s, lo), min(e, hi)) for s, e in intervals_ns if e > lo and s < hi]
    if not intervals_ns:
        return 0.0
    span = max(e for _s, e in intervals_ns) - min(s for s, _e in intervals_ns)
    return union_length(intervals_ns) / (window_ns if clip is not None else max(window_ns, span))


class BusyWindow(threading.Thread):
    """A CUDA-activity profiler window of ``seconds`` from ``start`` (perf_counter time).

    The profiler's session belongs to the thread that starts it, so this thread starts it and also
    stops it, but only when :meth:`finish` is called after the run: stopping parses the trace with
    the GIL held, which would stall the serving threads. Kernels are clipped to the window on the
    profiler's clock (wall-clock nanoseconds, like ``time.time_ns``), so the rest of the run is not
    counted; where no recorded kernel falls inside the window (another clock), the fraction is over
    the recorded span instead and ``busy_clock`` says so.
    """

    def __init__(self, start: float, seconds: float, device: str = "cuda") -> None:
        super().__init__(daemon=True)
        self.start_at, self.seconds, self.device = start, seconds, device  # "cpu": host ops (the CPU test)
        self.prof = None
        self.wall_ns = 0
        self.perf_start = None
        self.error = None
        self.intervals: list[tuple[int, int]] = []
        self.run_over = threading.Event()

    @staticmethod
    def warm() -> None:
        """Initialize CUPTI once, in the main thread, before any timed run (its first start is slow)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]):
            torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()

    def run(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        try:
            wait = self.start_at - time.perf_counter()
            if wait > 0 and self.run_over.wait(wait):
                self.error = "the run ended before the window"
                return
            act = ProfilerActivity.CUDA if self.device == "cuda" else ProfilerActivity.CPU
            self.prof = profile(activities=[act])  # CUDA: no host-side op recording
            self.prof.start()
            self.wall_ns, self.perf_start = time.time_ns(), time.perf_counter()
            self.run_over.wait()
            self.prof.stop()
            kind = torch.autograd.DeviceType.CUDA if self.device == "cuda" else torch.autograd.DeviceType.CPU
            for ev in self.prof.profiler.kineto_results.events():
                if ev.device_type() != kind:
                    continue
                name = ev.name().lower()
                if "memcpy" in name or "memset" in name:
                    continue
                self.intervals.append((ev.start_ns(), ev.start_ns() + ev.duration_ns()))
        except Exception as e:  # noqa: BLE001 -- a failed window costs the figure, not the run
            self.error = repr(e)

    def finish(self, base: float) -> dict:
        """After the run: stop the profiler and measure; ``base``: the run's t0 on the perf clock."""
        self.run_over.set()
        self.join()
        if self.error or self.perf_start is None:
            return dict(busy_fraction=None, busy_error=self.error or "no window")
        window = (self.perf_start - base, self.perf_start - base + self.seconds)
        if self.device == "cuda" and not self.intervals:  # an idle GPU still runs the chunks' kernels
            return dict(busy_fraction=None, busy_error="no kernel recorded", busy_window=window)
        w_ns = int(self.seconds * 1e9)
        clip = (self.wall_ns, self.wall_ns + w_ns)
        inside = sum(1 for s, e in self.intervals if e > clip[0] and s < clip[1])
        if inside or not self.intervals:
            frac, clock = busy_fraction(self.intervals, w_ns, clip), "wall"
        else:
            frac, clock = busy_fraction(self.intervals, w_ns), "span"
        lo, hi = clip if clock == "wall" else (min(s for s, _e in self.intervals), max(e for _s, e in self.intervals))
        summed = sum(min(e, hi) - max(s, lo) for s, e in self.intervals if e > lo and s < hi)
        # summed kernel time over the window: above the union where lanes' kernels overlap
        return dict(busy_fraction=frac, busy_kernels=inside or len(self.intervals), busy_clock=clock,
                    busy_window=window, kernel_sum_fraction=summed / max(1, hi - lo))


class NvmlSampler(threading.Thread):
    """NVML utilization of the given GPUs every ``every`` s while running (nothing without pynvml)."""

    def __init__(self, gpus: list[str], every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.gpus, self.every = gpus, every
        self.samples: list[list[float]] = [[] for _ in gpus]
        self.stop_at = float("inf")
        self.start_at = 0.0
        self.error = None

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(int(g)) if g.isdigit()
                       else pynvml.nvmlDeviceGetHandleByUUID(g) for g in self.gpus]
            while time.time() < self.stop_at:
                if time.time() >= self.start_at:
                    for i, h in enumerate(handles):
                        self.samples[i].append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100)
                time.sleep(self.every)
        except Exception as e:  # noqa: BLE001 -- no pynvml, no NVML figure
            self.error = repr(e)

    def result(self) -> dict:
        per = [sum(s) / len(s) if s else None for s in self.samples]
        vals = [v for v in per if v is not None]
        return dict(nvml_util=sum(vals) / len(vals) if vals else None, nvml_util_per_gpu=per)


# --------------------------------------------------------------------------- SRc: one worker process per GPU
def run_worker(args) -> None:
    """A long-lived SRc process on one GPU: build, export, optimize, then serve what the coordinator sends."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    import cadence_fx as cf

    device = _child_setup()
    t0 = time.perf_counter()
    bench = build_bench(args, device)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eps = bench.export()
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    replay: object = "auto"
    if device == "cuda" and args.branches > 1:  # each lane forks the backend, branches included
        from cadence_fx.replay import CudaGraphBackend

        replay = CudaGraphBackend(branches=args.branches, blas_streams=args.blas_streams)
    prog = cf.optimize(eps, bench.contract, lanes=args.lanes, replay=replay)
    optimize_s = time.perf_counter() - t0
    del eps
    release_unreferenced(bench.step, prog)
    first = bench.step.fresh(1, bench.spk)[0]
    warm = prog.warmup(*[first.get(n) for n in bench.step.inputs])["seconds"]
    if device == "cuda" and args.busy_window > 0:
        # CUPTI torn down and set up again beside CUDA graphs can crash (torch.profiler turns teardown
        # off itself when it knows graphs are in use: here it cannot know), and every N opens a window
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
        BusyWindow.warm()
    say(dict(ready=True, gpu=args.worker, device=_device_name(device), build_s=build_s, export_s=export_s,
             optimize_s=optimize_s, warmup_s=warm, lanes=len(prog.lanes.lanes),
             base_census_mib={k: v / 2**20 for k, v in prog.memory_census().items()}))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        say(_worker_serve(prog, bench, cmd, args, device))


def _worker_serve(prog, bench: Bench, cmd: dict, args, device: str) -> dict:
    """Serve this GPU's sessions of one run; returns per-chunk records, digests, joins, memory, busy."""
    step = bench.step
    n, mine, period, chunks = cmd["n"], cmd["sessions"], cmd["period"], cmd["chunks"]
    base = cmd["t0"] + (time.perf_counter() - time.time())  # t0 on this process's perf_counter clock
    harness.sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_join = time.perf_counter()
    sessions = {i: None if cmd["join_live"] else prog.session(f"s{i}", seed=i % cmd["scripts"]) for i in mine}
    joins: list[list[float]] = []
    if not cmd["join_live"] and mine:  # joined before the traffic: the mean join
        per = (time.perf_counter() - t_join) * 1e3 / len(mine)
        joins = [[i, -1.0, per] for i in mine]
    fresh = {i: _script_tokens(bench, i % cmd["scripts"], chunks) for i in mine}
    # each session starts from the prompt's state, which stays on the device (one copy, every session's
    # prompt is the benchmark's): its first call copies it into the session's own buffers, device to
    # device, as a server passes a joining conversation's prompt state. Staged per session up front, the
    # copies would all be live at once and count in the row's peak as memory per session; copied from
    # the host at each first chunk, 32 prompt states (hundreds of MiB each, from pageable memory) would
    # queue behind each other in the first second
    state: dict[int, dict | None] = {i: None for i in mine}
    pcm: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    records: list[list[float]] = []
    host_ms: list[float] = []  # per chunk: the session call's host time (launching, not waiting for, its kernels)
    due = [(base + i * period / n, i, 0) for i in mine]
    heapq.heapify(due)
    late_start = max(0.0, time.perf_counter() - base)  # ready after t0: the first arrivals wait for it
    cond = threading.Condition()
    done = [0]
    total = len(mine) * chunks
    busy = None
    if device == "cuda" and cmd["busy_window"] > 0:
        # the last busy_window seconds of arrivals: each of them still sees every session streaming
        start = base + max(0.0, period * chunks - cmd["busy_window"])
        busy = BusyWindow(start, cmd["busy_window"])
        busy.start()

    lane_streams = {ln.stream.cuda_stream for ln in prog.lanes.lanes if ln.stream is not None}
    shared = [0]  # serving threads whose stream is also a lane's: their copies queue behind that lane's chunks

    def worker() -> None:
        stream = torch.cuda.Stream() if device == "cuda" else None
        if stream is not None and stream.cuda_stream in lane_streams:
            with cond:
                shared[0] += 1
        while True:
            with cond:
                while not due and done[0] < total:
                    cond.wait()
                if not due:
                    return
                arrive, i, k = heapq.heappop(due)
            wait = arrive - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            t_call = time.perf_counter()
            with (torch.cuda.stream(stream) if stream is not None else _null()):
                with torch.no_grad():
                    if sessions[i] is None:  # --join-live: the session joins at its first chunk
                        tj = time.perf_counter()
                        sessions[i] = prog.session(f"s{i}", seed=i % cmd["scripts"])
                        joins.append([i, tj - base, (time.perf_counter() - tj) * 1e3])
                    if state[i] is None:
                        state[i] = dict(bench.state0)
                    out = sessions[i](*step.next_args(fresh[i][k], state[i]))
                t_host = time.perf_counter()  # the call returned: what is left is the device's
                wav = out[0].to("cpu")  # the PCM on the host: the chunk is ready
            ready = time.perf_counter()
            state[i] = step.carry(out)
            with cond:
                pcm[i].append(wav)
                records.append([i, k, arrive - base, ready - base])
                host_ms.append((t_host - t_call) * 1e3)
                done[0] += 1
                if k + 1 < chunks:
                    heapq.heappush(due, (arrive + period, i, k + 1))
                cond.notify_all()
                if done[0] % max(1, total // 5) == 0 or done[0] == total:
                    print(f"[N={n}] {done[0]}/{total} chunks", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers or len(prog.lanes.lanes))]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # CPU seconds of the process per wall second: near 1 with the threads' Python serialized on the GIL
    host = dict(cpu_per_wall=(time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0),
                threads_on_lane_streams=shared[0],
                call_p50_ms=harness.percentile(host_ms, 50), call_p99_ms=harness.percentile(host_ms, 99),
                timeline=timeline(records, period))
    reply = dict(gpu=args.worker, records=records, host=host, sha={str(i): sha256_tensors(pcm[i]) for i in mine}, joins=joins,
                 peak_mib=harness.peak_mib(), late_start_s=late_start, counters=prog.counters(),
                 per_session_mib=next((s.nbytes() / 2**20 for s in sessions.values() if s is not None), None),
                 census_mib={k: v / 2**20 for k, v in prog.memory_census().items()})
    if busy is not None:
        reply.update(busy.finish(base))
    for s in sessions.values():
        if s is not None:
            s.close()
    return reply


def timeline(records: list[list[float]], period: float, window: float = 10.0) -> list[list[float]]:
    """Latency by arrival time: per ``window``-second slice of arrivals, ``[start s, p50 ms, p99 ms,
    misses]`` (misses: over ``period``), to tell a backlog that builds from a transient."""
    window = max(window, 10.0 * period)
    by: dict[int, list[float]] = {}
    for _i, _k, arrive, ready in records:
        by.setdefault(int(arrive // window), []).append((ready - arrive) * 1e3)
    return [[w * window, round(harness.percentile(v, 50), 1), round(harness.percentile(v, 99), 1),
             sum(x > period * 1e3 for x in v)] for w, v in sorted(by.items())]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Worker:
    """The coordinator's handle on one worker process: JSON lines in and out, stderr relayed."""

    def __init__(self, g: int, cmd: list[str], env: dict) -> None:
        self.g = g
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, bufsize=1)
        self.tail: collections.deque = collections.deque(maxlen=60)
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line)
            if "Warning" not in line and "warn(" not in line:
                sys.stderr.write(f"[gpu {self.g}] {line}")
                sys.stderr.flush()

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.relay.join(timeout=5)
            raise RuntimeError(f"worker on gpu {self.g} exited (rc {self.proc.returncode}):\n" + "".join(self.tail))
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- the coordinator
def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def child_env(visible: list[str], g: int) -> dict:
    """A child's environment: one GPU (``visible[g]``), numbered as NVML numbers them; on a host
    without GPUs (the CPU smoke test) the "GPUs" are just separate processes."""
    env = dict(os.environ)
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible[g]
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def worker_env(env: dict, connections: int) -> dict:
    """An SRc worker's environment: ``CUDA_DEVICE_MAX_CONNECTIONS`` (the device's hardware work queues)
    set to ``connections`` unless 0. The driver's default is 8 queues; streams beyond that share one
    and wait on each other's kernels. A worker runs one stream per serving thread and one per lane
    after the first (more with branches), so 8 lanes alone would need 15."""
    if connections:
        env = dict(env, CUDA_DEVICE_MAX_CONNECTIONS=str(connections))
    return env


def _passthrough(args) -> list[str]:
    out = ["--model", args.model, "--dtype", args.dtype, "--scripts", str(args.scripts), "--period", str(args.period)]
    return out + (["--reduced"] if args.reduced else [])


class Run:
    """One benchmark run: the solo digests, the rows so far, and where they are written."""

    def __init__(self, args) -> None:
        self.args = args
        self.visible = visible_gpus()
        self.chunks = max(1, int(round(args.seconds / args.period)))
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.solo: dict[int, str] = {}
        self.solo_gpu: dict[int, int] = {}
        self.device = None
        self.meta: dict = {}
        self.warm_s = args.warm_seconds if args.warm_seconds is not None else (10.0 if self.visible else 0.0)

    # ------------------------------------------------------------------ rows
    def add(self, row: dict) -> None:
        self.rows.append(row)
        if "error" in row:
            print(f"[{row['cell']} gpus={row.get('gpus')} N={row.get('n_sessions')}] FAILED\n{row['error']}",
                  file=sys.stderr, flush=True)
        else:
            print(f"[{row['cell']} gpus={row['gpus']} N={row['n_sessions']}] p50 {row['p50_ms']:.0f} ms p99 "
                  f"{row['p99_ms']:.0f} ms misses {row['misses']}/{row['chunks']} exact {row['bitexact']} peak "
                  f"{_fmt(row['peak_mib'], '.0f')} MiB busy {_fmt(row.get('busy_fraction'), '.2f')} nvml "
                  f"{_fmt(row.get('nvml_util'), '.2f')} join p50/max {_fmt(row.get('join_p50_ms'), '.1f')}/"
                  f"{_fmt(row.get('join_max_ms'), '.1f')} ms", file=sys.stderr, flush=True)
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

    # ------------------------------------------------------------------ solo runs
    def start_solo(self, k: int) -> tuple[list, Path]:
        """One process per GPU runs its share of the scripts alone through the stock code."""
        tmp = Path(tempfile.mkdtemp(prefix="cadence-solo-"))
        procs = []
        k = min(k, self.args.scripts) if self.visible else 1  # without GPUs, one process does them all
        for g in range(k):
            scripts = [s for s in range(self.args.scripts) if s % k == g]
            cmd = [sys.executable, __file__, "--solo", ",".join(map(str, scripts)), "--out", str(tmp / f"solo{g}.json"),
                   "--seconds", str(self.args.seconds)] + _passthrough(self.args)
            with open(tmp / f"solo{g}.err", "w") as err:  # a file: a pipe nobody reads yet could fill up
                procs.append((g, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                                  env=child_env(self.visible, g))))
        return procs, tmp

    def finish_solo(self, procs, tmp: Path) -> None:
        for g, p in procs:
            p.wait()
            f = tmp / f"solo{g}.json"
            if p.returncode != 0 or not f.exists():
                raise SystemExit(f"solo stock run on gpu {g} failed:\n{(tmp / f'solo{g}.err').read_text()[-3000:]}")
            got = json.loads(f.read_text())
            self.device = self.device or got["device"]
            for s, sha in got["sha"].items():
                self.solo[int(s)] = sha
                self.solo_gpu[int(s)] = g
        self.meta["solo_s"] = max((json.loads((tmp / f"solo{g}.json").read_text())["solo_s"] for g, _ in procs),
                                  default=None)
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"solo stock runs: {len(self.solo)} scripts x {self.chunks} chunks", file=sys.stderr, flush=True)

    def adopt_solo(self, path: str) -> None:
        """``--solo-from``: the solo digests of an earlier run's report, where every setting they depend
        on is this run's (model, dtype, sizes, chunks, scripts, torch); the device is compared once this
        run knows its own (:meth:`check_solo_device`). Anything else is an error, never a silent gate."""
        rep = json.loads(Path(path).read_text())
        a = self.args
        want = dict(model=a.model, dtype=a.dtype, reduced=a.reduced, chunks_per_session=self.chunks,
                    torch=torch.__version__)
        diff = {k: (rep.get(k), v) for k, v in want.items() if rep.get(k) != v}
        missing = [s for s in range(a.scripts) if str(s) not in (rep.get("solo_sha") or {})]
        if diff or missing:
            raise SystemExit(f"--solo-from {path}: its solo digests do not fit this run "
                             f"({', '.join(f'{k}: report {r!r}, run {v!r}' for k, (r, v) in diff.items())}"
                             f"{'; no digest for script(s) ' + str(missing) if missing else ''})")
        self.solo = {s: rep["solo_sha"][str(s)] for s in range(a.scripts)}
        self.solo_gpu = {s: int((rep.get("solo_gpu") or {}).get(str(s), 0)) for s in range(a.scripts)}
        self.meta.update(solo_from=path, solo_device=rep.get("device"))
        print(f"solo digests of {len(self.solo)} scripts from {path}", file=sys.stderr, flush=True)

    def check_solo_device(self) -> None:
        """Digests taken on another GPU model gate nothing here: a kernel choice may differ."""
        theirs = self.meta.get("solo_device")
        if theirs is not None and self.device is not None and theirs != self.device:
            raise SystemExit(f"--solo-from: the solo digests were taken on a {theirs}, this run is on a {self.device}")

    # ------------------------------------------------------------------ SRc
    def start_workers(self, k: int) -> list[Worker]:
        a = self.args
        common = ["--lanes", str(a.lanes), "--workers", str(a.workers), "--busy-window", str(a.busy_window),
                  "--branches", str(a.branches), *(["--blas-streams", str(a.blas_streams)] if a.blas_streams else [])]
        return [Worker(g, [sys.executable, __file__, "--worker", str(g)] + common + _passthrough(a),
                       worker_env(child_env(self.visible, g), a.cuda_connections)) for g in range(k)]

    def _serve_cmd(self, n: int, g: int, j: int, t0: float, chunks: int, busy_window: float) -> dict:
        """What worker ``j`` of a ``g``-GPU group serves of an N-session run: sessions ``j, j+g, ...``."""
        a = self.args
        return dict(cmd="serve", n=n, sessions=[i for i in range(n) if i % g == j], t0=t0, period=a.period,
                    chunks=chunks, scripts=a.scripts, join_live=a.join_live, busy_window=busy_window)

    def warm(self, workers: list[Worker], gpus: list[int], sessions: dict[int, list[int]]) -> None:
        """Every worker, at once, serves an untimed ``--warm-seconds`` stream of its share of the first N it
        will serve (the first row of the first GPU count whose first batch uses it); nothing is a row."""
        a = self.args
        chunks = int(round(self.warm_s / a.period))
        if chunks <= 0:
            return
        first: dict[int, tuple[int, int, int]] = {}  # worker -> (n, g, j)
        for g in gpus:
            if not sessions[g]:
                continue
            width = max(1, len(workers) // g) if a.pack else 1
            for k in range(min(width * g, len(workers))):
                first.setdefault(k, (sessions[g][0], g, k % g))
        t_start = time.monotonic()
        t0 = time.time() + min(a.lead, 0.5)  # untimed: a late start only delays the warm stream
        for k, (n, g, j) in first.items():
            workers[k].send(self._serve_cmd(n, g, j, t0, chunks, 0.0))
        per = []
        for k, (n, g, j) in first.items():
            part = workers[k].receive()
            lat = [(r[3] - r[2]) * 1e3 for r in part["records"]]
            per.append(dict(gpu=k, n_sessions=n, gpus=g, sessions=len(part["sha"]), chunks=len(lat),
                            p50_ms=harness.percentile(lat, 50), p99_ms=harness.percentile(lat, 99),
                            misses=sum(x > a.period * 1e3 for x in lat), peak_mib=part["peak_mib"]))
        self.meta.setdefault("SRc", {})["warm"] = dict(seconds=self.warm_s, chunks_per_session=chunks,
                                                       wall_s=time.monotonic() - t_start, per_worker=per)
        print(f"warm stream: {self.warm_s:g} s at N=" + ",".join(f"{p['n_sessions']}(gpu {p['gpu']})" for p in per)
              + f" in {time.monotonic() - t_start:.1f} s (not a row)", file=sys.stderr, flush=True)

    def run_src(self, workers: list[Worker], gpus: list[int], sessions: dict[int, list[int]]) -> None:
        a = self.args
        ready = [w.receive() for w in workers]
        self.device = self.device or ready[0]["device"]
        self.check_solo_device()
        self.meta["SRc"] = dict(workers=ready)
        self.warm(workers, gpus, sessions)
        for g in gpus:
            todo = list(sessions[g])
            width = max(1, len(workers) // g) if a.pack else 1  # --pack: the same N on disjoint GPU groups
            while todo:
                n0, todo = todo[0], todo[1:]
                batch = [n0] * width
                if self.over_budget("SRc", g, n0, a.seconds + a.lead + 15):
                    break
                t0 = time.time() + a.lead
                groups = [workers[j * g:(j + 1) * g] for j in range(len(batch))]
                samplers = [self._nvml([w.g for w in grp], t0) for grp in groups]
                for n, grp in zip(batch, groups):
                    for j, w in enumerate(grp):
                        w.send(self._serve_cmd(n, g, j, t0, self.chunks, a.busy_window))
                rows = []
                for rep_i, (n, grp, nvml) in enumerate(zip(batch, groups, samplers)):
                    parts = [w.receive() for w in grp]
                    nvml.stop_at = 0
                    row = merge_row("SRc", g, n, parts, self.solo, a.scripts, a.period, self.chunks)
                    row.update(nvml.result(), lanes=a.lanes, branches=a.branches, blas_streams=a.blas_streams,
                               cuda_connections=a.cuda_connections, join_live=a.join_live,
                               host=[p.get("host") for p in parts],
                               gpu_ids=[w.g for w in grp],
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
                   script_sha=_script_sha(results, a.scripts), threads_per_process=procs.threads)
        return row


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
            cmd = [sys.executable, __file__, "--child", str(i), "--n", str(n), "--dir", str(self.dir),
                   "--threads", str(self.threads), "--seconds", str(a.seconds)] + _passthrough(a)
            with open(self.dir / f"s{i}.err", "w") as err:  # a file: nobody reads a pipe while the models build
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                                   env=child_env(run.visible, i % g)))

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


def _script_sha(results: list[dict], scripts: int) -> dict:
    digests: dict[int, set] = {}
    for i, r in enumerate(results):
        digests.setdefault(i % scripts, set()).add(r["sha"])
    return {str(k): sorted(v) for k, v in digests.items()}


def merge_row(cell: str, g: int, n: int, parts: list[dict], solo: dict[int, str], scripts: int, period: float,
              chunks: int) -> dict:
    """One row from the per-GPU parts of one run: ``records`` ([session, chunk, arrival s, ready s],
    times from the shared t0), ``sha`` (session -> PCM digest), ``joins`` ([session, t s, ms]),
    ``peak_mib`` and, where measured, ``busy_fraction``.

    ``bitexact``: every session served all its chunks and its PCM equals its script's solo stock run.
    """
    budget_ms = period * 1e3
    lat = [(r[3] - r[2]) * 1e3 for p in parts for r in p["records"]]
    misses = sum(x > budget_ms for x in lat)
    sha = {int(i): d for p in parts for i, d in p["sha"].items()}
    served = collections.Counter(int(r[0]) for p in parts for r in p["records"])
    exact = (len(sha) == n and all(served[i] == chunks for i in range(n))
             and all(solo.get(i % scripts) is not None and sha.get(i) == solo[i % scripts] for i in range(n)))
    joins = [j for p in parts for j in p["joins"]]
    join_ms = [j[2] for j in joins]
    # other sessions' chunks, on the joiner's GPU, pending at a live join or arriving in the second after it
    window_misses = 0
    for p in parts:
        for i, tj, _ms in p["joins"]:
            if tj < 0:
                continue
            window_misses += sum(1 for r in p["records"] if r[0] != i and tj - period < r[2] <= tj + period
                                 and (r[3] - r[2]) * 1e3 > budget_ms)
    per_gpu = []
    profiled_misses = None
    for p in parts:
        pl = [(r[3] - r[2]) * 1e3 for r in p["records"]]
        if p.get("busy_window"):  # the profiler is on from the window's start to the end of the run
            w0 = p["busy_window"][0]
            profiled_misses = (profiled_misses or 0) + sum(1 for r in p["records"] if r[3] > w0
                                                           and (r[3] - r[2]) * 1e3 > budget_ms)
        per_gpu.append(dict(gpu=p["gpu"], sessions=len(p["sha"]), chunks=len(pl), p50_ms=harness.percentile(pl, 50),
                            p99_ms=harness.percentile(pl, 99), misses=sum(x > budget_ms for x in pl),
                            peak_mib=p.get("peak_mib"), busy_fraction=p.get("busy_fraction"),
                            busy_kernels=p.get("busy_kernels"), busy_clock=p.get("busy_clock"),
                            kernel_sum_fraction=p.get("kernel_sum_fraction"),
                            busy_window=p.get("busy_window"), busy_error=p.get("busy_error")))
    peaks = [p.get("peak_mib") for p in parts]
    busy = [p.get("busy_fraction") for p in parts if p.get("busy_fraction") is not None]
    return dict(cell=cell, name=cell, gpus=g, n_sessions=n, p50_ms=harness.percentile(lat, 50),
                p95_ms=harness.percentile(lat, 95), p99_ms=harness.percentile(lat, 99), max_ms=max(lat, default=None),
                misses=misses, chunks=len(lat), peak_mib=sum(peaks) if all(x is not None for x in peaks) else None,
                bitexact=exact, busy_fraction=sum(busy) / len(busy) if busy else None,
                busy_per_gpu=[p.get("busy_fraction") for p in parts], misses_while_profiling=profiled_misses,
                join_p50_ms=harness.percentile(join_ms, 50) if join_ms else None,
                join_max_ms=max(join_ms) if join_ms else None,
                join_window_misses=window_misses if any(j[1] >= 0 for j in joins) else None,
                per_gpu=per_gpu, session_sha={str(k): v for k, v in sorted(sha.items())})


def limits(rows: list[dict]) -> dict:
    """Per cell and GPU count: the largest N run without a miss (and exact), the smallest N with misses;
    and the ratio of the largest GPU count's limit to one GPU's. An N run more than once (``--pack``'s
    repeats) is clean only if every run of it is."""
    out: dict = {}
    runs: dict = {}
    for r in rows:
        if "error" not in r:
            runs.setdefault((r["cell"], r["gpus"], r["n_sessions"]), []).append(r)
    for (cell, g, n), rs in runs.items():
        e = out.setdefault(cell, {}).setdefault(str(g), dict(largest_n_no_miss=None, smallest_n_with_misses=None))
        if all(r["misses"] == 0 and r["bitexact"] for r in rs):
            e["largest_n_no_miss"] = max(e["largest_n_no_miss"] or 0, n)
        elif any(r["misses"] for r in rs):
            m = e["smallest_n_with_misses"]
            e["smallest_n_with_misses"] = n if m is None else min(m, n)
    for per in out.values():
        one = (per.get("1") or {}).get("largest_n_no_miss")
        most = max((int(k) for k in per if k.isdigit()), default=1)
        top = per[str(most)]["largest_n_no_miss"]
        if most > 1 and one and top:
            per["ratio"] = dict(gpus=most, largest_over_one=top / one)
    return out


# --------------------------------------------------------------------------- stock child processes
def run_solo_child(args) -> None:
    device = _child_setup()
    bench = build_bench(args, device)
    chunks = max(1, int(round(args.seconds / args.period)))
    t0 = time.perf_counter()
    sha = {s: _solo_stock(bench, int(s), chunks) for s in args.solo.split(",") if s}
    Path(args.out).write_text(json.dumps(dict(sha=sha, device=_device_name(device), solo_s=time.perf_counter() - t0)))


def run_stock_child(args) -> None:
    """One stock process of a :class:`StockRow`: build the model, say ready, wait for the row's t0 (or
    ``stop``), run one conversation from the prompt state as the stock driver does, write the result."""
    device = _child_setup()
    if device == "cuda":
        torch.set_num_threads(args.threads)
    bench = build_bench(args, device)
    step = bench.step
    script = args.child % args.scripts
    chunks = max(1, int(round(args.seconds / args.period)))
    fresh = _script_tokens(bench, script, chunks)
    d = Path(args.dir)
    (d / f"ready{args.child}").write_text("1")
    while not (d / "go").exists():
        if (d / "stop").exists():
            return
        time.sleep(0.05)
    t0 = float((d / "go").read_text())
    start = t0 + args.child * args.period / args.n
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
                                   device=_device_name(device))))
    os.replace(tmp, d / f"s{args.child}.json")


# --------------------------------------------------------------------------- driver
def per_gpu_lists(spec: str, gpus: list[int]) -> dict[int, list[int]]:
    """``--sessions``: one comma list per GPU count ('/'-separated), or one list, which is the N of the
    smallest GPU count and is scaled for the others (``16,18`` with ``--gpus 1,2``: 16,18 and 32,36)."""
    groups = str(spec).split("/")
    if len(groups) == 1:
        base = [int(x) for x in groups[0].split(",") if x]
        return {g: [x * g // gpus[0] for x in base] for g in gpus}
    if len(groups) != len(gpus):
        raise SystemExit(f"{spec!r} has {len(groups)} '/'-separated lists but --gpus has {len(gpus)} entries")
    return {g: [int(x) for x in grp.split(",") if x] for g, grp in zip(gpus, groups)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="SRc,stock")
    ap.add_argument("--gpus", default=None, help="GPU counts to sweep, e.g. 1,2 (default: every visible GPU, or 1)")
    ap.add_argument("--sessions", default="4,8,16,24,32,48,64",
                    help="N for the SRc cell, ascending; one list per --gpus entry separated by '/', or one list "
                         "(the first GPU count's, scaled for the others)")
    ap.add_argument("--stock-sessions", default="1,2,4,6,8", help="N for the stock cell (same form as --sessions)")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of audio per session, so per N (default 60)")
    ap.add_argument("--period", type=float, default=1.0,
                    help="seconds between a session's chunks, also the deadline (1 s: one chunk is 1 s of audio; "
                         "shorter only for smoke runs)")
    ap.add_argument("--lanes", type=int, default=4, help="lanes of the SRc program, per GPU")
    ap.add_argument("--workers", type=int, default=0, help="serving threads per GPU (default: one per lane)")
    ap.add_argument("--branches", type=int, default=1,
                    help="SRc: streams per captured graph (CudaGraphBackend(branches=N): independent chains in "
                         "parallel; 1: one stream)")
    ap.add_argument("--blas-streams", type=int, default=None,
                    help="SRc with --branches: how many of each graph's streams may run matrix products (each keeps "
                         "a cuBLAS workspace per lane); default all")
    ap.add_argument("--cuda-connections", type=int, default=32,
                    help="CUDA_DEVICE_MAX_CONNECTIONS of the SRc workers (default 32, the most; 0: the driver's 8)")
    ap.add_argument("--scripts", type=int, default=4)
    ap.add_argument("--full-sweep", action="store_true", help="keep sweeping N after the first misses")
    ap.add_argument("--pack", action="store_true",
                    help="SRc: run the rows of a GPU count below the largest side by side on disjoint GPUs, only "
                         "rows of the same N (with --gpus 1,2: N on GPU 0 and N on GPU 1, two independent one-GPU "
                         "rows, a repeat; never a row beside a larger, overloaded one; each row still has its GPUs "
                         "to itself, the host is shared, as in the two-GPU rows)")
    ap.add_argument("--warm-seconds", type=float, default=None,
                    help="SRc: an untimed stream of this many seconds per worker, at the first N it will serve, "
                         "before its first measured row (default 10 with GPUs, 0 without; 0: none)")
    ap.add_argument("--join-live", action="store_true",
                    help="each session joins when its first chunk arrives (during the others' traffic)")
    ap.add_argument("--busy-window", type=float, default=1.0,
                    help="seconds of the profiler window for the GPU busy fraction, ending at the last arrival "
                         "(0: off)")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds from sending a run to its t0")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="skip any N that would end later than this many seconds after the start (0: no limit)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--solo-from", default=None,
                    help="take the solo stock digests from an earlier run's --json report instead of running them "
                         "again (the same model, dtype, sizes, chunks, scripts, torch and GPU model, else an error)")
    ap.add_argument("--model", default="token2wav", choices=("token2wav", "demo"),
                    help="demo: the small demo decoder, for CPU smoke tests of the process layout")
    ap.add_argument("--reduced", action="store_true", help="reduced Token2Wav sizes (CPU smoke run)")
    ap.add_argument("--json", default=None, help="the report (rewritten after every row)")
    ap.add_argument("--rows", default=None, help="also append every row to this file (JSON lines)")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--solo", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model == "token2wav":
        dtype_hook(args.dtype)  # fail here, before any process starts, where there is no such path
    if args.worker is not None:
        return run_worker(args)
    if args.solo is not None:
        return run_solo_child(args)
    if args.child is not None:
        return run_stock_child(args)

    run = Run(args)
    gpus = sorted({int(x) for x in args.gpus.split(",")}) if args.gpus else [max(1, len(run.visible))]
    if run.visible and max(gpus) > len(run.visible):
        raise SystemExit(f"--gpus {args.gpus}: only {len(run.visible)} GPU(s) visible")
    cells = [c for c in args.cells.split(",") if c]
    k = max(gpus)
    if args.solo_from:
        run.adopt_solo(args.solo_from)
    solo = None if args.solo_from else run.start_solo(k)
    # the SRc workers build beside the solo runs when SRc comes first; otherwise when its turn comes
    # (they hold their GPU's memory until the SRc cell is over)
    workers = run.start_workers(k) if cells[:1] == ["SRc"] else []
    try:
        if solo is not None:
            run.finish_solo(*solo)
        for cell in cells:
            if cell == "SRc":
                workers = workers or run.start_workers(k)
                try:
                    run.run_src(workers, gpus, per_gpu_lists(args.sessions, gpus))
                except RuntimeError as e:
                    run.add(dict(cell="SRc", name="SRc", gpus=None, n_sessions=None, error=str(e)[-3000:]))
                for w in workers:
                    w.close()
            elif cell == "stock":
                # each row starts its own stock processes (StockRow): none sit idle beside the SRc rows
                run.run_stock(gpus, per_gpu_lists(args.stock_sessions, gpus))
            else:
                raise SystemExit(f"unknown cell {cell!r} (SRc, stock)")
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    report = run.report()
    print(table(run.rows))
    print("limits: " + json.dumps(report["limits"]))
    if args.json:
        harness.write_json(args.json, report)


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and v == v else "n/a"


def table(rows: list[dict]) -> str:
    head = (f"{'cell':<6}{'gpus':>5}{'N':>5}{'p50 ms':>9}{'p99 ms':>9}{'misses':>12}{'peak MiB':>10}{'busy':>6}"
            f"{'nvml':>6}{'join p50/max ms':>17}{'join-window misses':>20}{'exact':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['cell']:<6}{r.get('gpus')!s:>5}{r.get('n_sessions')!s:>5}  failed")
            continue
        join = f"{_fmt(r.get('join_p50_ms'), '.1f')}/{_fmt(r.get('join_max_ms'), '.1f')}"
        lines.append(f"{r['cell']:<6}{r['gpus']:>5}{r['n_sessions']:>5}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
                     f"{str(r['misses']) + '/' + str(r['chunks']):>12}{_fmt(r['peak_mib'], '.0f'):>10}"
                     f"{_fmt(r.get('busy_fraction'), '.2f'):>6}{_fmt(r.get('nvml_util'), '.2f'):>6}{join:>17}"
                     f"{str(r.get('join_window_misses')):>20}{str(r['bitexact']):>7}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
