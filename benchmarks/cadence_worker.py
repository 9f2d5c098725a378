"""The SRc cell's worker process: one per GPU, long-lived, serving one N after another.

:func:`run_worker` is the process (``benchmarks/cadence.py --worker G``): it builds the model from the
benchmark seed, exports the catalog and optimizes it once (``--lanes`` lanes), says it is ready, then
serves every run the coordinator sends (:func:`serve`): worker threads, one per lane unless
``--workers``, take the due chunks earliest first and call each session of the program. The protocol
is JSON lines, commands on stdin and replies on stdout (anything else printed goes to stderr).
:class:`Worker` is the coordinator's end of it; :func:`worker_env` the process's environment.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import json
import math
import os
import subprocess
import sys
import threading
import time

import torch

from benchmarks import harness
from benchmarks.cadence_measure import BusyWindow, gpu_memory_line, timeline
from benchmarks.cadence_model import Bench, build_bench, child_setup, device_name
from benchmarks.cadence_traffic import first_arrival, script_tokens
from benchmarks.token2wav import release_unreferenced
from cadence_fx.determinism import sha256_tensors


def run_worker(args) -> None:
    """A long-lived SRc process on one GPU: build, export, optimize, then serve what the coordinator sends."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    import cadence_fx as cf

    device = child_setup()
    replay: object = "auto"
    if device == "cuda" and args.branches > 1:  # each lane forks the backend, branches included
        from cadence_fx.runtime.backends import CudaGraphBackend

        replay = CudaGraphBackend(branches=args.branches, blas_streams=args.blas_streams)
    load_s = ready_s = None
    if args.artifact and os.path.exists(args.artifact):
        # a server restarting from its artifact: load every lane and capture it before anything else
        # (warm-up needs only the catalog's shapes), so ready_s is what a worker from an artifact takes;
        # the stock model is built after that, only to drive the benchmark's inputs and prompt state
        t0 = time.perf_counter()
        prog = cf.load(args.artifact, lanes=args.lanes, replay=replay)
        load_s = time.perf_counter() - t0
        warm = prog.warmup(full_lanes=args.full_lanes)["seconds"]
        ready_s = seconds_since_process_start()
        t0 = time.perf_counter()
        bench = build_bench(args, device)
        build_s = time.perf_counter() - t0
        export_s = optimize_s = 0.0
        release_unreferenced(bench.step, prog)
        release_parameters(bench.step)  # the loaded program has its own weights
    else:
        t0 = time.perf_counter()
        bench = build_bench(args, device)
        build_s = time.perf_counter() - t0
        prog, export_s, optimize_s = build_program(cf, bench, args, replay)
        release_unreferenced(bench.step, prog)
        first = bench.step.fresh(1, bench.spk)[0]
        warm = prog.warmup(*[first.get(n) for n in bench.step.inputs], full_lanes=args.full_lanes)["seconds"]
    if device == "cuda" and args.busy_window > 0:
        # CUPTI torn down and set up again beside CUDA graphs can crash (torch.profiler turns teardown
        # off itself when it knows graphs are in use: here it cannot know), and every N opens a window
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
        BusyWindow.warm()
    say(dict(ready=True, gpu=args.worker, device=device_name(device), build_s=build_s, export_s=export_s,
             optimize_s=optimize_s, load_s=load_s, ready_s=ready_s, warmup_s=warm, lanes=len(prog.lanes.lanes),
             base_census_mib={k: v / 2**20 for k, v in prog.memory_census().items()}))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        say(serve(prog, bench, cmd, args, device))


def build_program(cf, bench: Bench, args, replay: object) -> tuple[object, float, float]:
    """The SRc program exported and optimized (and saved to ``--artifact``, when named, for the next
    worker to load). Returns it with the export and optimize seconds."""
    t0 = time.perf_counter()
    eps = bench.export()
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    prog = cf.optimize(eps, bench.contract, lanes=args.lanes, replay=replay, journal=args.journal)
    optimize_s = time.perf_counter() - t0
    del eps
    if args.artifact:
        cf.save(prog, args.artifact)  # before any call: the program as optimize left it (cf.save replaces atomically)
    return prog, export_s, optimize_s


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux: /proc), interpreter start-up and imports included."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def release_parameters(step) -> int:
    """Free the stock module's parameters (a loaded program has its own copies); returns the bytes. A
    later use of one would fail on its empty storage, not compute with stale bytes."""
    freed = 0
    for p in step.parameters():
        storage = p.untyped_storage()
        if storage.nbytes() and storage.resizable():
            freed += storage.nbytes()
            storage.resize_(0)
    return freed


def open_session(prog, name: str, seed: int, pin: bool):
    """A session of ``prog``; with ``pin``, pinned to a lane of its own while one is left."""
    if pin:
        from cadence_fx import NoLaneToPin
        try:
            return prog.session(name, seed=seed, pin=True)
        except NoLaneToPin:
            pass
    return prog.session(name, seed=seed)


def serve(prog, bench: Bench, cmd: dict, args, device: str) -> dict:
    """Serve this GPU's sessions of one run; returns per-chunk records, digests, joins, memory, busy."""
    step = bench.step
    n, mine, period, chunks = cmd["n"], cmd["sessions"], cmd["period"], cmd["chunks"]
    base = cmd["t0"] + (time.perf_counter() - time.time())  # t0 on this process's perf_counter clock
    harness.sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_join = time.perf_counter()
    sessions = {i: None if cmd["join_live"] else open_session(prog, f"s{i}", i % cmd["scripts"], cmd.get("pin", False)) for i in mine}
    joins: list[list[float]] = []
    if not cmd["join_live"] and mine:  # joined before the traffic: the mean join
        per = (time.perf_counter() - t_join) * 1e3 / len(mine)
        joins = [[i, -1.0, per] for i in mine]
    fresh = {i: script_tokens(bench, i % cmd["scripts"], chunks) for i in mine}
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
    due = [(first_arrival(base, i, n, period), i, 0) for i in mine]
    heapq.heapify(due)
    late_start = max(0.0, time.perf_counter() - base)  # ready after t0: the first arrivals wait for it
    cond = threading.Condition()
    done = [0]
    total = len(mine) * chunks
    cutoff = base + cmd.get("cutoff_s", math.inf)  # past it, nothing more is served (cadence_run.row_cutoff_s)
    cut = [False]
    busy = None
    if device == "cuda" and cmd["busy_window"] > 0:
        # the last busy_window seconds of arrivals: each of them still sees every session streaming
        start = base + max(0.0, period * chunks - cmd["busy_window"])
        busy = BusyWindow(start, cmd["busy_window"], keep_union=cmd.get("busy_union", False))
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
                while not due and done[0] < total and not cut[0]:
                    cond.wait()
                if not due or cut[0]:
                    return
                arrive, i, k = heapq.heappop(due)
            wait = arrive - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if time.perf_counter() > cutoff:  # the row is cut: this chunk and what is left count as missed
                with cond:
                    cut[0] = True
                    cond.notify_all()
                return
            t_call = time.perf_counter()
            with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                with torch.no_grad():
                    if sessions[i] is None:  # --join-live: the session joins at its first chunk
                        tj = time.perf_counter()
                        sessions[i] = open_session(prog, f"s{i}", i % cmd["scripts"], cmd.get("pin", False))
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
                    # the time into the row and this chunk's latency say, for a row cut before it
                    # writes anything, whether it was keeping up (the line still ends in "chunks")
                    print(f"[N={n}] {ready - base:.1f} s in, latest {(ready - arrive) * 1e3:.0f} ms: "
                          f"{done[0]}/{total} chunks", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers or len(prog.lanes.lanes))]
    from cadence_fx.runtime import rng as rng_mod

    rng_mod.draw_lock_stats(reset=True)
    lockless_before = rng_mod.LOCKLESS_DRAW_REPLAY
    # the row's mode, read at every replay of a graph that draws (no thread is serving yet)
    rng_mod.LOCKLESS_DRAW_REPLAY = cmd.get("draw_replay", "lock") == "lockless"
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        rng_mod.LOCKLESS_DRAW_REPLAY = lockless_before
    # CPU seconds of the process per wall second: near 1 with the threads' Python serialized on the GIL
    host = dict(cpu_per_wall=(time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0),
                threads_on_lane_streams=shared[0],
                call_p50_ms=harness.percentile(host_ms, 50), call_p99_ms=harness.percentile(host_ms, 99),
                timeline=timeline(records, period),
                # the process-wide lock of every draw (sessions' streams, graph generator swaps): its waits
                # and holds, against the row's wall time
                draw_lock=rng_mod.draw_lock_stats())
    reply = dict(gpu=args.worker, slot=getattr(args, "slot", 0), records=records, host=host, sha={str(i): sha256_tensors(pcm[i]) for i in mine}, joins=joins,
                 abandoned=total - done[0],
                 peak_mib=harness.peak_mib(), late_start_s=late_start, counters=prog.counters(),
                 per_session_mib=next((s.nbytes() / 2**20 for s in sessions.values() if s is not None), None),
                 census_mib={k: v / 2**20 for k, v in prog.memory_census().items()})
    if busy is not None:
        reply.update(busy.finish(base))
    for s in sessions.values():
        if s is not None:
            s.close()
    return reply


def worker_env(env: dict, connections: int) -> dict:
    """An SRc worker's environment: ``CUDA_DEVICE_MAX_CONNECTIONS`` (the device's hardware work queues)
    set to ``connections`` unless 0. The driver's default is 8 queues; streams beyond that share one
    and wait on each other's kernels. A worker runs one stream per serving thread and one per lane
    after the first (more with branches), so 8 lanes alone would need 15."""
    if connections:
        env = dict(env, CUDA_DEVICE_MAX_CONNECTIONS=str(connections))
    return env


class Worker:
    """The coordinator's handle on one worker process: JSON lines in and out, stderr relayed."""

    def __init__(self, g: int, cmd: list[str], env: dict, slot: int = 0) -> None:
        self.g = g
        self.slot = slot  # which of its GPU's worker processes (--procs-per-gpu)
        self.name = f"gpu {g}" if slot == 0 else f"gpu {g}.{slot}"
        self.visible = env.get("CUDA_VISIBLE_DEVICES", str(g)).split(",")[0]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, bufsize=1)
        self.tail: collections.deque = collections.deque(maxlen=60)
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line)
            if "Warning" not in line and "warn(" not in line:
                sys.stderr.write(f"[{self.name}] {line}")
                sys.stderr.flush()

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.relay.join(timeout=5)
            raise RuntimeError(f"worker on {self.name} exited (rc {self.proc.returncode}):\n" + "".join(self.tail)
                               + gpu_memory_line(self.visible))
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
