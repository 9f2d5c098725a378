"""Conversations at the real-time cadence through the streaming front end against the same program in process.

    python benchmarks/serve_capacity.py --artifact .out/token2wav.cfx --sessions 16,32 --json cap.json  # a GPU
    python benchmarks/serve_capacity.py --model demo --sessions 1,2 --seconds 3 --json smoke.json      # the CPU

Issue 30's front-end target: through the front end, at least 95 % of the in-process capacity, with
no missed deadline. The capacity is the largest N (of ``--sessions``) whose conversations, each one
chunk per ``--period`` (the real-time cadence), all get every chunk's outputs back on the host
within ``--deadline`` of the chunk's due time.

The artifact is ``--artifact``; when the file is absent it is built, exported, optimized and saved
here first, as ``benchmarks/serve_token2wav.py`` builds its own (its ``Model``), and beside it goes
``PATH.inputs.pt``: the conversations' prompt (the state after the stock step's setup) and the
chunk scripts, so that a later call on the same machine loads the file and skips the build. An
artifact without that file is served from the worker's stand-ins (zeros of the first class for
the state, seeded random values for the chunk's float inputs and zeros for the others).

Two kinds of rows, per N, every row the same workload: conversation ``i`` runs script ``i mod
--scripts`` with that script's seed; its chunk ``k`` is due at ``t0 + i * period / N + k * period``
(starts staggered over one period) and is sent at its due time, or when its previous chunk's reply
is in if that is later (one chunk in flight per conversation, as the protocol has it); a chunk's
latency runs from its due time to its outputs on the host, and a miss is a latency over the deadline.

- ``in_process``: the artifact loaded in this process (``cf.load(path, lanes=L)``, ``warmup``), one
  session per conversation, each chunk run on a pool of L threads (a worker's way: one call per
  lane at once). Before the rows, each script runs alone through a session of this program for as
  many chunks as a row sends (the *solo* runs, the bytes every stream must equal). The program is
  freed before the service starts.
- ``service``: a Ray head on this node, the controller and ONE worker actor loaded from the same
  artifact with L lanes and the whole GPU (like for like with the in-process rows), the front end
  (``cadence_fx.serve.frontend.app`` over ``RayBackend``, one replica) on Ray Serve, and N WebSocket
  clients in this process (``StreamClient``), one connection per conversation. Checkpoints are off
  unless ``--checkpoint-every`` asks for them: their cost is ``serve_token2wav.py``'s to measure, and
  here it would hide what the front end costs.

Every stream's outputs (all chunks, in order) are checked against its script's solo run by SHA-256
(``exact``). The report (``--json``, rewritten after every row) has each row's p50/p99/max latency,
misses and exactness, ``by_sessions`` the two side by side per N, and ``capacity`` the largest N
without a miss of each kind, their ratio and whether it meets 0.95 with every stream exact. A kind
stops at its first N with a miss (``--keep-going`` runs every N); a row that would not fit in what is
left of ``--time-budget`` is skipped and said so; at ``--hard-stop`` the report is written as it
stands, Ray is stopped, and the exit status is 124.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import hashlib
import math
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks import serve_token2wav as t2w_bench  # noqa: E402  (the artifact's build, Ray's setup, digests)

log, ms = t2w_bench.log, t2w_bench.ms
NAMESPACE = "cadence_fx_capacity"  # the controller's, so the Serve replica finds it by name
CONTROLLER = "cadence_fx_capacity_controller"
TARGET = 0.95
SEED0 = 100  # script s has seed SEED0 + s
INPUTS_SUFFIX = ".inputs.pt"
MIN_SCRIPT_CHUNKS = 300  # chunks kept per script in the inputs file: later calls may ask for longer rows


def inputs_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + INPUTS_SUFFIX)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- the backend in the replica
def capacity_backend(controller: str, namespace: str, inputs: str | None = None) -> Any:
    """The front end's backend, built in the Serve replica: a ``RayBackend`` over the benchmark's
    controller. Every conversation opens from the inputs file's prompt, put in the object store once
    here: each open hands the controller that one reference instead of the prompt's bytes."""
    import ray

    from cadence_fx.serve import wire
    from cadence_fx.serve.ray_backend import ray_backend

    prompt = None
    if inputs:
        wire.install()
        held = torch.load(inputs, weights_only=True)["prompt"]
        if held is not None:
            ref = ray.put(held)

            def prompt(_p: int | None) -> Any:
                return ref
    return ray_backend(controller, namespace=namespace, prompt=prompt)


# --------------------------------------------------------------------------- inputs
class Inputs:
    """The prompt (by region, on the host, or ``None`` for the worker's zeros) and the chunk scripts."""

    def __init__(self, prompt: dict[str, torch.Tensor] | None, scripts: list[list[dict[str, torch.Tensor]]],
                 file: Path | None, sha256: str) -> None:
        self.prompt, self.scripts, self.file, self.sha256 = prompt, scripts, file, sha256

    def script_of(self, conv: int, count: int) -> int:
        return conv % count

    def chunk(self, script: int, k: int, names: Sequence[str]) -> list[torch.Tensor]:
        """Chunk ``k`` of ``script`` in the order the program takes them (a script shorter than the row
        starts over: the solo runs read the same chunks)."""
        frames = self.scripts[script % len(self.scripts)]
        f = frames[k % len(frames)]
        return [f[n] for n in names]


def build_artifact(args: argparse.Namespace, path: Path, report: dict) -> None:
    """``serve_token2wav``'s build (stock step, export, optimize, save) into ``path``, and the inputs file."""
    folder = path.parent / f".build-{path.name}"
    folder.mkdir(parents=True, exist_ok=True)
    args.max_chunks = 1  # the Model's own scripts: this benchmark draws its own
    model = t2w_bench.Model(args, folder, report)
    spk = model.scripts[t2w_bench.ROUTED][0].get("spk")  # the speaker embedding, on the host (Token2Wav)
    names = model.layout.chunk_names
    chunks = max(args.chunks, MIN_SCRIPT_CHUNKS)
    scripts = [[{n: f[n].detach().cpu() for n in names} for f in model.step.fresh(chunks, spk, seed=SEED0 + s)]
               for s in range(args.scripts)]
    os.replace(model.path, path)
    torch.save({"sha256": model.sha, "model": args.model, "sizes": report["build"]["sizes"],
                "prompt": model.prompt, "scripts": scripts}, inputs_path(path))
    shutil.rmtree(folder, ignore_errors=True)
    del model
    free_device()


def read_inputs(args: argparse.Namespace, path: Path, prog: Any, layout: Any) -> Inputs:
    side = inputs_path(path)
    if side.exists():
        held = torch.load(side, weights_only=True)
        want = "demo" if args.model == "demo" else "reduced" if args.reduced else "released"
        if (held.get("model"), held.get("sizes")) != (args.model, want):
            raise SystemExit(f"{side} holds {held.get('model')} at {held.get('sizes')} sizes; this run asks for "
                             f"{args.model} at {want} sizes (another --artifact path)")
        return Inputs(held["prompt"], held["scripts"], side, held["sha256"])
    # an artifact this benchmark did not build: the worker's stand-ins (its zeros), seeded values
    chunk0, _state = layout.zeros(prog, "cpu")
    scripts = []
    for s in range(args.scripts):
        g = torch.Generator().manual_seed(SEED0 + s)
        scripts.append([{n: torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else
                         torch.zeros_like(t) for n, t in zip(layout.chunk_names, chunk0)}
                        for _ in range(args.chunks)])
    return Inputs(None, scripts, None, file_sha256(path))


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the two ways in
class InProcess:
    """Conversations as sessions of the program in this process, chunks on a pool of L threads."""

    def __init__(self, prog: Any, layout: Any, inputs: Inputs, device: str, lanes: int) -> None:
        self.prog, self.layout, self.inputs, self.device = prog, layout, inputs, device
        self.pool = ThreadPoolExecutor(lanes, thread_name_prefix="cadence-capacity")
        self.zero_state = layout.zeros(prog, device)[1]

    def open_now(self, name: str, script: int) -> dict[str, Any]:
        """As a worker opens one: a session seeded with the script's seed, restored from the prompt."""
        import cadence_fx as cf

        session = self.prog.session(name, seed=SEED0 + script)
        prompt = self.inputs.prompt
        state = ({n: t.to(self.device) for n, t in prompt.items()} if prompt is not None else
                 {n: t.clone() for n, t in self.zero_state.items()})
        return {"session": session, "state": session.restore(cf.Snapshot(state, None)), "script": script}

    def step_now(self, conv: dict[str, Any], k: int) -> tuple:
        """Chunk ``k``: its inputs to the device, the call, the returned state kept, the outputs on the host."""
        chunk = [t.to(self.device) for t in self.inputs.chunk(conv["script"], k, self.layout.chunk_names)]
        out = conv["session"](*self.layout.call_args(chunk, conv["state"]))
        visible, conv["state"] = self.layout.split_outputs(out)
        return tuple(t2w_bench._host(o) for o in visible)

    async def open(self, i: int, script: int) -> dict[str, Any]:
        return self.open_now(f"conv-{i}", script)

    async def chunk(self, conv: dict[str, Any], k: int) -> tuple:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.step_now, conv, k)

    async def close(self, conv: dict[str, Any]) -> None:
        conv["session"].close()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


class Service:
    """Conversations through the front end: one WebSocket connection and ``StreamClient`` each."""

    def __init__(self, url: str, inputs: Inputs, names: Sequence[str], deadline_s: float) -> None:
        self.url, self.inputs, self.names, self.deadline_s = url, inputs, list(names), deadline_s
        self.flagged = 0  # replies the front end itself marked as past the deadline (from the frame's arrival)

    async def open(self, i: int, script: int) -> dict[str, Any]:
        import websockets

        from cadence_fx.serve.protocol import StreamClient

        # no compression: float PCM barely deflates, and both ends would pay for trying
        ws = await websockets.connect(self.url, max_size=None, compression=None, ping_interval=None)
        client = StreamClient(ws)
        opened = await client.open(seed=SEED0 + script, prompt=None if self.inputs.prompt is None else 0,
                                   deadline_ms=self.deadline_s * 1e3)
        return {"ws": ws, "client": client, "conv": opened["conv"], "script": script}

    async def chunk(self, conv: dict[str, Any], k: int) -> tuple:
        from cadence_fx.serve.protocol import DEADLINE_MISSED

        frame = await conv["client"].chunk(conv["conv"], k, self.inputs.chunk(conv["script"], k, self.names))
        self.flagged += bool(frame.flags & DEADLINE_MISSED)
        return frame.tensors

    async def close(self, conv: dict[str, Any]) -> None:
        await conv["client"].close(conv["conv"])
        await conv["ws"].close()


# --------------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        cuda = args.device == "cuda"
        self.report: dict[str, Any] = {
            "bench": "serve_capacity", "target_ratio": TARGET,
            "command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "device": args.device,
            "gpu": torch.cuda.get_device_name() if cuda else None, "host": platform.node(),
            "host_cores": os.cpu_count(), "args": vars(args), "rows": [], "skipped": [], "phases": {}}
        self.solo: dict[int, str] = {}
        self.clean: dict[str, bool] = {"in_process": True, "service": True}
        self.ray_up = False

    # ------------------------------------------------------------------ plumbing
    def save(self) -> None:
        self.report["wall_s"] = time.perf_counter() - t2w_bench.T_START
        if self.args.json:
            harness.write_json(self.args.json, self.report)

    def left(self) -> float:
        return self.args.time_budget - (time.perf_counter() - t2w_bench.T_START)

    def phase(self, name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        log(f"phase {name}")
        self.report["phase_running"] = name
        try:
            return fn()
        finally:
            self.report["phases"][name] = time.perf_counter() - t0
            self.report.pop("phase_running", None)
            self.save()

    def row_fits(self, mode: str, n: int) -> bool:
        a = self.args
        if not self.clean[mode] and not a.keep_going:
            self.report["skipped"].append(f"{mode} N={n}: a smaller N missed deadlines (--keep-going runs it)")
            return False
        need = a.seconds + 2 * a.period + 5
        if self.left() < need:
            self.report["skipped"].append(f"{mode} N={n}: {self.left():.0f} s left of the time budget, a row "
                                          f"takes about {need:.0f} s")
            return False
        return True

    # ------------------------------------------------------------------ a row
    async def _row(self, api: Any, n: int) -> dict[str, Any]:
        a = self.args
        scripts = [i % a.scripts for i in range(n)]
        gate = asyncio.Semaphore(a.open_concurrency)  # a service open moves the prompt: a few at a time

        async def opened(i: int) -> Any:
            async with gate:
                return await api.open(i, scripts[i])

        t_open = time.perf_counter()
        convs = await asyncio.gather(*(opened(i) for i in range(n)))
        open_s = time.perf_counter() - t_open
        lat: list[list[float]] = [[] for _ in range(n)]
        outs: list[list[tuple]] = [[] for _ in range(n)]
        lag: list[float] = []  # due time to send: the event loop's wake-up, or the previous reply still out
        t0 = time.perf_counter() + 0.1

        async def run(i: int) -> None:
            for k in range(a.chunks):
                due = t0 + i * a.period / n + k * a.period
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                lag.append(time.perf_counter() - due)
                out = await api.chunk(convs[i], k)
                lat[i].append(time.perf_counter() - due)
                outs[i].append(tuple(out))

        await asyncio.gather(*(run(i) for i in range(n)))
        traffic_s = time.perf_counter() - t0
        await asyncio.gather(*(api.close(c) for c in convs))
        flat = [x for xs in lat for x in xs]
        exact = [t2w_bench._digest(outs[i]) == self.solo[scripts[i]] for i in range(n)]
        return {"sessions": n, "chunks_per_conversation": a.chunks, "chunks": len(flat), "latency": ms(flat),
                "send_lag": ms(lag), "misses": sum(x > a.deadline for x in flat), "exact": all(exact), "streams_exact": sum(exact),
                "inexact_conversations": [i for i, ok in enumerate(exact) if not ok], "open_s": open_s,
                "traffic_s": traffic_s}

    def row(self, mode: str, api: Any, n: int) -> None:
        r = {"mode": mode, **asyncio.run(self._row(api, n))}
        if mode == "service":
            r["flagged_by_front_end"], api.flagged = api.flagged, 0
        self.report["rows"].append(r)
        self.clean[mode] = self.clean[mode] and r["misses"] == 0
        lt = r["latency"]
        log(f"{mode} N={n}: p50 {lt['p50_ms']:.2f} ms, p99 {lt['p99_ms']:.2f} ms, max {lt['max_ms']:.2f} ms; "
            f"{r['misses']}/{r['chunks']} past {self.args.deadline * 1e3:g} ms; exact {r['streams_exact']}/{n}")
        self.summarize()
        self.save()

    # ------------------------------------------------------------------ phases
    def in_process(self, path: Path, *, rows: bool = True) -> None:
        """Load, warm up, the solo runs, then the in-process rows (``rows``), then free the program."""
        import cadence_fx as cf
        from cadence_fx.serve.layout import StepLayout

        a = self.args
        t0 = time.perf_counter()
        prog = cf.load(path, lanes=a.lanes, replay=a.replay, device=a.device)
        t_load = time.perf_counter()
        layout = StepLayout.of(prog)
        chunk0, state0 = layout.zeros(prog, a.device)
        prog.warmup(*layout.call_args(chunk0, state0))  # as a worker warms up: the first class's zeros
        harness.sync()
        self.inputs = read_inputs(a, path, prog, layout)
        self.chunk_names = layout.chunk_names
        self.report["in_process_setup"] = {"load_s": t_load - t0, "warmup_s": time.perf_counter() - t_load,
                                           "lanes": a.lanes, "chunk_inputs": list(layout.chunk_names),
                                           "inputs_file": str(self.inputs.file) if self.inputs.file else None,
                                           "prompt": self.inputs.prompt is not None}
        log(f"in process: loaded in {t_load - t0:.1f} s, {a.lanes} lane(s) warmed up in "
            f"{self.report['in_process_setup']['warmup_s']:.1f} s")
        api = InProcess(prog, layout, self.inputs, a.device, a.lanes)
        try:
            t0 = time.perf_counter()
            secs = []
            for s in range(min(a.scripts, max(a.sessions))):  # each script alone: the bytes to equal
                conv = api.open_now(f"solo-{s}", s)
                outs = []
                for k in range(a.chunks):
                    t = time.perf_counter()
                    outs.append(api.step_now(conv, k))
                    secs.append(time.perf_counter() - t)
                conv["session"].close()
                self.solo[s] = t2w_bench._digest(outs)
            self.report["solo"] = {"scripts": len(self.solo), "chunks": a.chunks, "seconds": time.perf_counter() - t0,
                                   "chunk_alone": ms(secs), "sha256": {str(s): d for s, d in self.solo.items()}}
            log(f"solo runs: {len(self.solo)} scripts x {a.chunks} chunks, a chunk alone p50 "
                f"{self.report['solo']['chunk_alone']['p50_ms']:.2f} ms")
            self.save()
            for n in a.sessions if rows else ():
                if self.row_fits("in_process", n):
                    self.row("in_process", api, n)
        finally:
            api.shutdown()
            del api, prog, chunk0, state0
            free_device()
            self.report["in_process_setup"]["gpu_used_mib_after_free"] = t2w_bench._gpu_used_mib()

    def start_service(self, path: Path) -> None:
        import ray
        from ray import serve

        from cadence_fx.serve import cluster, frontend, wire
        from cadence_fx.serve.checkpoints import CheckpointPolicy
        from cadence_fx.serve.controller import ControllerConfig, start_controller
        from cadence_fx.serve.worker import WorkerConfig

        a = self.args
        n_max = max(a.sessions)
        # the Serve replica imports this module's backend factory: Ray's processes inherit this path
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        prompt_bytes = sum(t.numel() * t.element_size() for t in (self.inputs.prompt or {}).values())
        # the controller keeps one copy of the prompt per open conversation (its failover base)
        want = int(a.object_store_gib * 2**30) if a.object_store_gib else \
            prompt_bytes * (n_max + 2) + (8 << 30 if a.device == "cuda" else 512 << 20)
        store, where = t2w_bench._object_store_bytes(want)
        t0 = time.perf_counter()
        cluster.init(address="local", namespace=NAMESPACE, num_cpus=a.ray_cpus,
                 num_gpus=1 if a.device == "cuda" else 0, object_store_memory=store, include_dashboard=False,
                 log_to_driver=a.worker_logs, runtime_env={"worker_process_setup_hook": t2w_bench.SETUP_HOOK})
        self.ray_up = True
        wire.install()
        setup: dict[str, Any] = {"ray": ray.__version__, "ray_init_s": time.perf_counter() - t0,
                                 "object_store_bytes": store, "object_store_in": where, "prompt_bytes": prompt_bytes}
        self.report["service_setup"] = setup
        policy = CheckpointPolicy(every=a.checkpoint_every, at_turn_end=False)
        # held here for the run: a controller no handle refers to is ended by Ray
        self.ctl = ctl = start_controller([], config=ControllerConfig(checkpoint=policy), name=CONTROLLER)
        config = WorkerConfig(str(path), sha256=self.inputs.sha256, lanes=a.lanes, replay=a.replay, device=a.device,
                              capacity=n_max, threads=1 if a.device == "cpu" else None)
        t0 = time.perf_counter()
        st = ray.get(ctl.add_worker.remote(config, "worker-0", {"num_gpus": 1 if a.device == "cuda" else 0,
                                                                "num_cpus": a.worker_cpus}),
                     timeout=a.start_timeout)
        setup["worker"] = {"client_wall_s": time.perf_counter() - t0, "ready_s": st.ready_s, "load_s": st.load_s,
                           "warmup_s": st.warmup_s, "lanes": st.lanes, "capacity": st.capacity, "device": st.device,
                           "checkpoint_every": a.checkpoint_every}
        log(f"worker ready in {setup['worker']['client_wall_s']:.1f} s (load {st.load_s:.1f} s, warm-up "
            f"{st.warmup_s:.1f} s) on {st.device}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        limits = {"deadline_ms": a.deadline * 1e3, "max_conversations": 1, "max_in_flight": 1}
        app = frontend.app("benchmarks.serve_capacity:capacity_backend",
                           {"controller": CONTROLLER, "namespace": NAMESPACE,
                            "inputs": str(self.inputs.file) if self.inputs.file else None},
                           config=limits, max_ongoing_requests=n_max + 16,
                           ray_actor_options={"num_cpus": a.frontend_cpus})
        serve.run(app, name="capacity", route_prefix="/")
        setup["frontend"] = {"start_s": time.perf_counter() - t0, "config": limits, "replicas": 1}
        self.url = f"ws://127.0.0.1:{port}/v1/stream"
        log(f"front end up in {setup['frontend']['start_s']:.1f} s at {self.url}")

    def service(self) -> None:
        api = Service(self.url, self.inputs, self.chunk_names, self.args.deadline)
        for n in self.args.sessions:
            if self.row_fits("service", n):
                self.row("service", api, n)

    def summarize(self) -> None:
        rows = self.report["rows"]
        by: dict[str, dict[str, Any]] = {}
        for r in rows:
            by.setdefault(str(r["sessions"]), {})[r["mode"]] = {
                "p50_ms": r["latency"]["p50_ms"], "p99_ms": r["latency"]["p99_ms"], "misses": r["misses"],
                "chunks": r["chunks"], "exact": r["exact"]}
        self.report["by_sessions"] = by

        def largest(mode: str) -> int | None:
            return max((r["sessions"] for r in rows if r["mode"] == mode and r["misses"] == 0), default=None)

        ip, sv = largest("in_process"), largest("service")
        ratio = sv / ip if ip and sv is not None else None
        exact = bool(rows) and all(r["exact"] for r in rows)
        self.report["exact"] = exact
        self.report["capacity"] = {"in_process": ip, "service": sv, "ratio": ratio, "target": TARGET,
                                   "met": ratio is not None and ratio >= TARGET and exact,
                                   "over": "the --sessions measured, largest N with 0 misses"}

    targets = summarize  # the name serve_token2wav's watchdog calls

    def finish(self, temp: Path | None) -> None:
        """The report written, Serve and Ray stopped (their logs' tails copied first), the temporary folder gone."""
        self.summarize()
        self.save()
        if self.ray_up:
            import ray
            from ray import serve

            try:
                serve.shutdown()
            except Exception as e:
                log(f"serve shutdown: {e!r}")
            if self.args.ray_logs:
                t2w_bench._copy_ray_logs(Path(self.args.ray_logs))
            ray.shutdown()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=None,
                    help="the artifact (built here when absent, with PATH.inputs.pt beside it; default: a temporary "
                         "folder, removed at the end)")
    ap.add_argument("--model", default="token2wav", choices=("token2wav", "demo"),
                    help="demo: the demo decoder on the CPU (the smoke test)")
    ap.add_argument("--reduced", action="store_true", help="Token2Wav at reduced sizes, on the CPU")
    ap.add_argument("--lanes", type=int, default=None, help="lanes, in process and in the worker (default 8 on a GPU, "
                                                            "1 on the CPU)")
    ap.add_argument("--sessions", default="8,16,32", help="conversation counts N, comma-separated, in order")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of traffic per row")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between a conversation's chunks")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from a chunk's due time to its outputs "
                                                                  "(default: the period)")
    ap.add_argument("--scripts", type=int, default=8, help="distinct chunk scripts (conversation i runs i mod this)")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="the service's checkpoint interval K (0: off)")
    ap.add_argument("--open-concurrency", type=int, default=4, help="conversations opened at once before a row")
    ap.add_argument("--keep-going", action="store_true", help="run every N even after a smaller one missed")
    ap.add_argument("--skip-in-process", action="store_true", help="service rows only (solo runs still run)")
    ap.add_argument("--skip-service", action="store_true", help="in-process rows only")
    ap.add_argument("--worker-cpus", type=float, default=1.0)
    ap.add_argument("--frontend-cpus", type=float, default=1.0)
    ap.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the Ray head (default: os.cpu_count())")
    ap.add_argument("--object-store-gib", type=float, default=None,
                    help="default: the prompt's bytes per conversation of the largest N, plus 8 GiB (0.5 on the CPU)")
    ap.add_argument("--start-timeout", type=float, default=400.0, help="seconds the worker may take to be ready")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds from the start (default 480 on a GPU, none on the CPU): a row that would end past "
                         "it is skipped")
    ap.add_argument("--hard-stop", type=float, default=None,
                    help="seconds from the start (default: the budget + 60 on a GPU, none on the CPU): write the "
                         "report, end Ray, exit 124 (0: none)")
    ap.add_argument("--worker-logs", action=argparse.BooleanOptionalAction, default=True,
                    help="Ray workers' output on this process's (log_to_driver)")
    ap.add_argument("--ray-logs", default=None, help="copy the Ray session's logs (tails) here at the end")
    ap.add_argument("--json", default=None, help="the report (rewritten after every row)")
    args = ap.parse_args(argv)
    small = args.reduced or args.model == "demo"
    args.device = "cuda" if torch.cuda.is_available() and not small else "cpu"
    gpu = args.device == "cuda"
    args.dtype = "float32"  # what serve_token2wav's Model builds
    args.replay = "auto" if gpu else "off"
    args.lanes = args.lanes or (8 if gpu else 1)
    args.sessions = [int(x) for x in str(args.sessions).split(",") if x.strip()]
    if not args.sessions or min(args.sessions) < 1:
        ap.error("--sessions: one or more counts >= 1")
    args.deadline = args.deadline if args.deadline is not None else args.period
    args.chunks = max(1, math.ceil(args.seconds / args.period))
    args.ray_cpus = args.ray_cpus or max(2, os.cpu_count() or 2)
    args.time_budget = args.time_budget if args.time_budget is not None else (480.0 if gpu else math.inf)
    if args.hard_stop is None:
        args.hard_stop = args.time_budget + 60 if gpu else 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cpu":  # the worker's setting (WorkerConfig.threads): one reduction order everywhere
        torch.set_num_threads(1)
    from cadence_fx.determinism import pin_envelope

    pin_envelope()  # the envelope the artifact is built and served in (the Ray workers' setup hook)
    bench = Bench(args)
    if args.hard_stop:
        # serve_token2wav's watchdog reads only report, targets(), save() and args.ray_logs
        t2w_bench._watchdog(bench, args.hard_stop)  # type: ignore[arg-type]
    temp = None
    if args.artifact:
        path = Path(args.artifact).resolve()
    else:
        temp = Path(tempfile.mkdtemp(prefix="cadence_fx_capacity_"))
        path = temp / f"{args.model}.cfx"
    status = 1
    try:
        if path.exists():
            bench.report["artifact"] = {"path": str(path), "built": False}
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            bench.phase("build", lambda: build_artifact(args, path, bench.report))
            bench.report["artifact"] = {"path": str(path), "built": True}
        bench.report["artifact"]["bytes"] = path.stat().st_size
        bench.phase("in_process", lambda: bench.in_process(path, rows=not args.skip_in_process))
        if not args.skip_service:
            setup = bench.report["in_process_setup"]
            # the worker loads and warms up what this process did, in a fresh process, before one row
            need = 1.2 * (setup["load_s"] + setup["warmup_s"]) + 30 + args.seconds + 2 * args.period + 5
            if bench.left() < need:
                bench.report["skipped"].append(f"service: {bench.left():.0f} s left of the time budget, its start "
                                               f"and one row take about {need:.0f} s")
            else:
                bench.phase("service_start", lambda: bench.start_service(path))
                bench.phase("service", bench.service)
        bench.summarize()
        status = 0 if bench.report["exact"] else 1
    except BaseException as e:  # the report says where it stopped
        bench.report["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-6000:]
        log(f"FAILED: {e!r}")
    finally:
        bench.finish(temp)
    c = bench.report["capacity"]
    log(f"capacity (largest N of {args.sessions} with 0 misses): in process {c['in_process']}, through the front end "
        f"{c['service']}, ratio {c['ratio']} (target {TARGET}); every stream exact: {bench.report.get('exact')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
