"""Token2Wav served on Ray, one GPU: worker ready time, routing overhead, migration, failover, checkpoint cost.

    python benchmarks/serve_token2wav.py --json serve.json            # released sizes, fp32 (scripts/gpu.sh serve)
    python benchmarks/serve_token2wav.py --reduced --json smoke.json  # reduced sizes on the CPU: a smoke test

One process tree on one device. This process builds the stock step (seeded random weights, as
``benchmarks/cold_start.py``), exports its catalog at the chunk clock, optimizes it and saves the
artifact once (``cf.save``). Every stream the benchmark serves is then run alone first, in this
process, through a session of the freshly optimized program (the *solo* runs: the bytes each served
stream must equal, and the in-process cost of a chunk), and the first ``--stock-chunks`` of one of them
through the unmodified stock step (``stock_prefix_exact``: the served bytes are the stock driver's).
Then a Ray head starts on this node (its GPU, ``ray.init``), a controller, and workers
(:class:`~cadence_fx.serve.worker.ConversationWorker` actors) loaded from the artifact, each holding
``--worker-gpus`` of the GPU (two workers of 0.5 share it) with ``--lanes`` lanes, started one after the
other. Measured, in this order (the JSON report is rewritten after each phase):

- ``ready`` (a): per worker, actor start to ready (process, imports, ``cf.load`` of the artifact, the
  warm-up of every lane: the controller's ``spawn_to_ready_s``) and the worker's own split of it. With
  ``--serve-from-lanes K`` a worker is ready once K lanes are captured and the others capture in the
  background: then, before the next phase, one conversation (``early-<worker>``) streams on it while
  they capture (each chunk's latency and the lanes online after it, up to ``--early-chunks`` or every
  lane online; its bytes checked as every stream's), then every lane is waited for
  (``wait_lanes``): ``lanes_ready_s`` (the worker's construction to every lane captured),
  ``spawn_to_all_lanes_s`` (actor start to every lane) and the capacity the controller then admits;
- ``routing`` (b): ``--chunks`` chunks of one conversation one after another through the controller:
  the client's latency per chunk and what routing adds over the in-process cost of the same chunk
  (``added`` = latency - ``StepResult.call_s``, the session call inside the worker), p50/p99; the same
  straight to the worker's handle (``direct``: one hop, no journal); an empty actor call to each
  (``ping``: Ray's floor per hop); and the in-process session call of the solo run in this process
  (``in_process``, on the same GPU before any worker started) with the latency's excess over it;
- ``migration`` (c): ``--moves`` moves of one live conversation between the two workers (export to
  the host, the object store, import; a chunk between moves): seconds per move and the state's bytes;
- ``checkpoint`` (e): ``--checkpoints`` checkpoints of each store (``controller``: the state copied to the
  controller's object store; ``worker``: left in the worker node's), and the worker's export alone,
  against the chunk's time: the cost as a percentage of the K chunks between two checkpoints
  (``--every`` K) in the worker's time (its export, what a checkpoint takes from capacity) and in wall
  time, and the K that keeps each under 5 %;
- ``failover`` (d): three conversations, two on the victim, one on the survivor, each checkpointed and
  then ``--every``/2 chunks further (a journal to re-run); a round of chunks is sent, and while the victim
  computes its two the victim's process is killed (``--kill sigkill``, or ``ray`` for ``ray.kill``): the
  seconds from the kill to each conversation's chunk answered by the survivor, the controller's resume
  seconds, then three more rounds; then (``--replacement``) a new worker joins (its ready time, a restart)
  and one conversation moves onto it;
- ``exact``: every served stream (each conversation's outputs, all chunks, by sequence number) against
  its solo run by SHA-256, with chunks lost or answered twice counted (0 and 0 is the gate).

``targets`` compares each figure with issue 30's: ready <= 20 s, routing p99 <= 2 ms added, migration
<= 100 ms, failover <= 3 s with nothing lost and identical bytes, checkpoints <= 5 % of capacity.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402

pct = harness.percentile
SETUP_HOOK = "cadence_fx.determinism.pin_envelope"  # every Ray worker process: the envelope the artifact was built in

# scripts (token streams and seeds) of the served conversations
ROUTED, DIRECT, MOVER, FAILOVER, ROUTER, EARLY = 1, 2, 3, (4, 5, 6), 7, 8


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f} s] {msg}", flush=True)


def ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3, "max_ms": max(xs, default=math.nan) * 1e3,
            "n": len(xs)}


def _host(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().cpu() if x.device.type != "cpu" else x.detach().clone()


def _digest(outputs: list[tuple]) -> str:
    from cadence_fx.determinism import sha256_tensors

    return sha256_tensors(t for out in outputs for t in out if isinstance(t, torch.Tensor))


# --------------------------------------------------------------------------- the model, once
class Model:
    """The stock step, its artifact, and the solo runs every served stream is checked against."""

    def __init__(self, args: argparse.Namespace, folder: Path, report: dict) -> None:
        import cadence_fx as cf
        from cadence_fx.adapters import token2wav as t2w
        from cadence_fx.adapters.stepaudio2 import load_stepaudio2
        from cadence_fx.determinism import describe_envelope, pin_envelope
        from cadence_fx.serve.layout import StepLayout

        self.args, self.device = args, args.device
        pin_envelope()
        t0 = time.perf_counter()
        if args.model == "demo":  # the demo decoder: the same path in seconds (the pytest's smoke)
            from benchmarks.cadence_model import build_bench

            bench = build_bench(args, self.device)
            self.step, self.state0, contract, spk = bench.step, bench.state0, bench.contract, None
            sizes = "demo"
        else:
            up = load_stepaudio2(Path(os.environ.get("CADENCE_FX_UPSTREAM", ROOT / ".upstream")) / "minicpmo-0.1.2")
            cfg = t2w.Token2WavConfig.reduced() if args.reduced else t2w.Token2WavConfig()
            torch.manual_seed(cfg.seed)
            step = t2w.Token2WavStep(t2w.build_flow(up, cfg), t2w.build_vocoder(up, cfg), cfg, driver="0.1.2")
            self.step = step.to(self.device).eval()
            tokens, mel, spk = (t.to(self.device) for t in t2w.example_prompt(cfg))
            self.state0 = self.step.setup(tokens, mel, spk)
            contract = t2w.token2wav_contract(cfg, "chunk", driver="0.1.2")
            sizes = "reduced" if args.reduced else "released"
        b = report["build"] = {"model": args.model, "device": describe_envelope()["device"], "torch": torch.__version__,
                               "sizes": sizes, "build_s": time.perf_counter() - t0}
        log(f"stock step built ({args.model}, {sizes} sizes) on {b['device']}")
        t0 = time.perf_counter()
        if args.model == "demo":
            eps = bench.export()
        else:
            eps = t2w.export_step_catalog(self.step, self.state0, self.step.fresh(3, spk, seed=99), contract,
                                          granularity="chunk")
        b["export_s"] = time.perf_counter() - t0
        b["classes"] = len(eps)
        log(f"exported {len(eps)} classes in {b['export_s']:.1f} s")
        t0 = time.perf_counter()
        self.prog = cf.optimize(eps, contract, replay=args.replay)
        harness.sync()
        b["optimize_s"] = time.perf_counter() - t0
        del eps
        self.path = folder / "token2wav.cfx"
        info = cf.save(self.prog, self.path)  # before any call: the program as optimize left it
        self.sha = info["sha256"]
        b.update(save_s=info["seconds"], artifact_bytes=info["bytes"], artifact_sha256=self.sha)
        log(f"optimized in {b['optimize_s']:.1f} s, saved {info['bytes'] / 2**20:.0f} MiB in {info['seconds']:.1f} s")
        self.layout = StepLayout.of(self.prog)
        self.regions = list(self.prog.contract.regions)
        # a conversation's prompt: the state after setup, by region name, on the host
        self.prompt = {r.name: self.state0[r.input].detach().cpu() for r in self.regions}
        b["prompt_bytes"] = sum(t.numel() * t.element_size() for t in self.prompt.values())
        self.scripts: dict[int, list[dict[str, torch.Tensor]]] = {}
        spk_host = spk.detach().cpu() if spk is not None else None
        for s in (ROUTED, DIRECT, MOVER, *FAILOVER, ROUTER, EARLY):
            self.scripts[s] = self.step.fresh(args.max_chunks, spk_host, seed=s)
        t0 = time.perf_counter()
        example = self.layout.call_args(self.chunk_on_device(ROUTED, 0), {n: t.to(self.device) for n, t in
                                                                          self._region_state().items()})
        self.prog.warmup(*example)
        harness.sync()
        b["in_process_warmup_s"] = time.perf_counter() - t0
        self.solo_outputs: dict[int, list[tuple]] = {}
        self.solo_call_s: dict[int, list[float]] = {}

    def _region_state(self) -> dict[str, torch.Tensor]:
        return {r.name: self.prompt[r.name] for r in self.regions}

    def chunk(self, script: int, k: int) -> dict[str, torch.Tensor]:
        """Chunk ``k`` of ``script`` as a client sends it: the chunk's own inputs by name, on the host."""
        f = self.scripts[script][k]
        return {n: f[n] for n in self.layout.chunk_names}

    def chunk_on_device(self, script: int, k: int) -> list[torch.Tensor]:
        return [t.to(self.device) for t in self.chunk(script, k).values()]

    # ------------------------------------------------------------------ solo runs
    def solo(self, script: int, chunks: int) -> None:
        """Conversation ``script`` alone through a session of the fresh program, as a worker runs it
        (open from the prompt with the script's seed, the state fed back, outputs to the host): its
        outputs per chunk, and each chunk's in-process seconds (the call with its outputs on the host)."""
        import cadence_fx as cf

        session = self.prog.session(f"solo-{script}", seed=script)
        state = session.restore(cf.Snapshot({n: t.to(self.device) for n, t in self._region_state().items()}, None))
        outs, secs = [], []
        for k in range(chunks):
            chunk = self.chunk_on_device(script, k)
            harness.sync()
            t0 = time.perf_counter()
            out = session(*self.layout.call_args(chunk, state))
            visible, state = self.layout.split_outputs(out)
            host = tuple(_host(o) for o in visible)
            secs.append(time.perf_counter() - t0)
            outs.append(host)
        session.close()
        self.solo_outputs[script], self.solo_call_s[script] = outs, secs

    def solo_digest(self, script: int, chunks: int) -> str | None:
        outs = self.solo_outputs.get(script, [])
        return _digest(outs[:chunks]) if len(outs) >= chunks else None

    def stock_prefix(self, script: int, chunks: int) -> bool:
        """The first ``chunks`` of ``script`` through the unmodified stock step (``driver_call``, seeded
        as ``torch.manual_seed(script)``, as a session seeded ``script`` draws) equal the solo run's."""
        torch.manual_seed(script)
        st = {k: v.clone() for k, v in self.state0.items()}
        outs = []
        state_out = set(self.step.state.values())
        for k in range(chunks):
            f = {n: t.to(self.device) for n, t in self.scripts[script][k].items()}
            with torch.no_grad():
                out = self.step.driver_call(*self.step.next_args(f, st))
            outs.append(tuple(_host(o) for j, o in enumerate(out) if j not in state_out))
            st = self.step.carry(out)
        return _digest(outs) == self.solo_digest(script, chunks)


# --------------------------------------------------------------------------- a client
class Stream:
    """One conversation's client: its chunks in order through the controller, every reply kept by
    sequence number (a chunk answered twice is counted, never overwritten)."""

    def __init__(self, bench: "Bench", conv: str, script: int) -> None:
        self.bench, self.conv, self.script = bench, conv, script
        self.k = 0
        self.outs: dict[int, tuple] = {}
        self.workers: list[str] = []
        self.twice = 0

    def open(self, worker: str | None = None) -> None:
        b = self.bench
        b.get(b.ctl.open.remote(self.conv, seed=self.script, prompt=b.prompt_ref, worker=worker))

    def send(self) -> tuple[int, Any]:
        b = self.bench
        ref = b.ctl.step.remote(self.conv, self.k, b.model.chunk(self.script, self.k))
        self.k += 1
        return self.k - 1, ref

    def receive(self, sent: tuple[int, Any]) -> Any:
        seq, ref = sent
        res = self.bench.get(ref)
        if res.seq != seq or res.conv_id != self.conv:
            raise AssertionError(f"{self.conv}: chunk {seq} answered as {res.conv_id!r} chunk {res.seq}")
        if seq in self.outs:
            self.twice += 1
        else:
            self.outs[seq] = tuple(res.outputs)
        self.workers.append(res.worker)
        return res

    def step(self) -> tuple[Any, float]:
        t0 = time.perf_counter()
        res = self.receive(self.send())
        return res, time.perf_counter() - t0

    def close(self) -> None:
        self.bench.get(self.bench.ctl.close.remote(self.conv))

    def verdict(self) -> dict[str, Any]:
        lost = [s for s in range(self.k) if s not in self.outs]
        got = _digest([self.outs[s] for s in range(self.k) if s in self.outs])
        want = self.bench.model.solo_digest(self.script, self.k)
        return {"chunks": self.k, "lost": len(lost), "answered_twice": self.twice, "sha256": got,
                "solo_sha256": want, "exact": (not lost and not self.twice and want is not None and got == want),
                "workers": sorted(set(self.workers))}


class RoutedStream(Stream):
    """A conversation's client through a :class:`~cadence_fx.serve.router.Router` in this process (the
    front end's path): one hop to the worker per chunk, the journal kept here, checkpoints asked of the
    controller every K chunks without waiting for them."""

    def __init__(self, bench: "Bench", conv: str, script: int, router: Any) -> None:
        super().__init__(bench, conv, script)
        self.router = router

    def open(self, worker: str | None = None) -> None:
        self.router.open(self.conv, seed=self.script, prompt=self.bench.model.prompt, worker=worker)

    def step(self) -> tuple[Any, float]:
        t0 = time.perf_counter()
        res = self.router.step(self.conv, self.k, self.bench.model.chunk(self.script, self.k))
        t = time.perf_counter() - t0
        if res.seq != self.k:
            raise AssertionError(f"{self.conv}: chunk {self.k} answered as chunk {res.seq}")
        self.outs[self.k] = tuple(res.outputs)
        self.workers.append(res.worker)
        self.k += 1
        return res, t

    def close(self) -> None:
        self.router.close(self.conv)


# --------------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report: dict[str, Any] = {"bench": "serve_token2wav", "args": vars(args), "phases": {}, "skipped": []}
        self.streams: list[Stream] = []
        self.ctl: Any = None
        self.handles: dict[str, Any] = {}

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout or self.args.call_timeout)

    def timed_call(self, method: Any) -> float:
        t = time.perf_counter()
        self.get(method.remote())
        return time.perf_counter() - t

    def save(self) -> None:
        self.report["wall_s"] = time.perf_counter() - T_START
        if self.args.json:
            harness.write_json(self.args.json, self.report)

    def phase(self, name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        log(f"phase {name}")
        self.report["phase_running"] = name
        try:
            fn()
        finally:
            self.report["phases"][name] = time.perf_counter() - t0
            self.report.pop("phase_running", None)
            self.save()

    def left(self) -> float:
        return self.args.time_budget - (time.perf_counter() - T_START)

    def stream(self, conv: str, script: int) -> Stream:
        s = Stream(self, conv, script)
        self.streams.append(s)
        return s

    # ------------------------------------------------------------------ phases
    def build(self, folder: Path) -> None:
        a = self.args
        self.model = Model(a, folder, self.report)
        m = self.model
        self.need = {ROUTED: a.warm + a.chunks, DIRECT: a.warm + a.chunks, ROUTER: a.warm + a.chunks,
                     MOVER: a.warm + 1 + 2 * a.moves + a.checkpoints}
        rounds = a.warm + a.every // 2 + 1 + 3 + (2 if a.replacement else 0)
        self.need.update({s: rounds for s in FAILOVER})
        if a.warming and a.early_chunks:  # a stream on a worker whose lanes are still capturing
            self.need[EARLY] = a.early_chunks
        t0 = time.perf_counter()
        for s, n in self.need.items():
            m.solo(s, n)
        calls = m.solo_call_s[ROUTED][a.warm:]
        self.report["solo"] = {"seconds": time.perf_counter() - t0, "chunks": dict(self.need),
                               "in_process": ms(calls)}
        log(f"solo runs: {sum(self.need.values())} chunks in {self.report['solo']['seconds']:.1f} s; in-process "
            f"chunk p50 {pct(calls, 50) * 1e3:.2f} ms, p99 {pct(calls, 99) * 1e3:.2f} ms")
        if a.stock_chunks:
            t0 = time.perf_counter()
            self.report["stock_prefix_exact"] = m.stock_prefix(ROUTED, min(a.stock_chunks, self.need[ROUTED]))
            log(f"stock prefix ({a.stock_chunks} chunks) equals the solo run: {self.report['stock_prefix_exact']} "
                f"({time.perf_counter() - t0:.1f} s)")

    def start_ray(self) -> None:
        import ray

        from cadence_fx.serve import cluster, wire
        from cadence_fx.serve.checkpoints import CheckpointPolicy
        from cadence_fx.serve.controller import ControllerConfig, start_controller

        a = self.args
        t0 = time.perf_counter()
        store, where = _object_store_bytes(int(a.object_store_gib * 2**30))
        cluster.init(address="local", num_cpus=a.ray_cpus, num_gpus=1 if a.device == "cuda" else 0,
                 object_store_memory=store, include_dashboard=False,
                 log_to_driver=a.worker_logs, runtime_env={"worker_process_setup_hook": SETUP_HOOK})
        wire.install()
        self.report["ray"] = {"version": ray.__version__, "init_s": time.perf_counter() - t0,
                              "object_store_bytes": store, "object_store_in": where,
                              "resources": ray.cluster_resources()}
        log(f"ray {ray.__version__} head up in {self.report['ray']['init_s']:.1f} s: {ray.cluster_resources()}")
        self.prompt_ref = ray.put(self.model.prompt)
        ccfg = ControllerConfig(checkpoint=CheckpointPolicy(every=a.every, store=a.store), health_interval_s=0.5)
        self.ctl = start_controller([], config=ccfg, name="cadence_fx_serve_bench")
        self.report["ready"] = {}

    def worker_config(self) -> Any:
        from cadence_fx.serve.worker import WorkerConfig

        a = self.args
        # only when asked: the old behaviour (and a WorkerConfig without the field) otherwise
        extra = {} if a.serve_from_lanes is None else {"serve_from_lanes": a.serve_from_lanes}
        return WorkerConfig(str(self.model.path), sha256=self.model.sha, lanes=a.lanes, replay=a.replay,
                            capacity=a.capacity, threads=1 if a.device == "cpu" else None, **extra)

    def worker_options(self) -> dict[str, Any]:
        return {"num_gpus": self.args.worker_gpus, "num_cpus": self.args.worker_cpus}

    def add_worker(self, name: str, started: Any = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        if started is None:
            started = self.ctl.add_worker.remote(self.worker_config(), name, self.worker_options())
        st = self.get(started, timeout=self.args.start_timeout)
        wall = time.perf_counter() - t0
        self.handles[name] = self.get(self.ctl.worker_handle.remote(name))
        ctl_view = self.get(self.ctl.status.remote())["workers"][name]
        row = {"spawn_to_ready_s": ctl_view["spawn_to_ready_s"], "client_wall_s": wall, "ready_s": st.ready_s,
               "load_s": st.load_s, "warmup_s": st.warmup_s, "calibrate_s": st.calibrate_s, "lanes": st.lanes,
               "capacity": st.capacity, "device": st.device, "gpu_used_mib": _gpu_used_mib(),
               "load_split": dict(st.load_split), "identity": st.identity,
               # a status without them (a worker that captures every lane before it is ready): all at once
               "lanes_online": getattr(st, "lanes_online", st.lanes),
               "capacity_full": getattr(st, "capacity_full", st.capacity),
               "lanes_ready_s": getattr(st, "lanes_ready_s", st.ready_s)}
        # the worker process's start before its constructor ran: interpreter, Ray's worker, imports
        row["process_and_imports_s"] = row["spawn_to_ready_s"] - st.ready_s
        row["spawn_to_all_lanes_s"] = self.to_all_lanes(row)
        self.report["ready"][name] = row
        log(f"{name} ready {row['spawn_to_ready_s']:.2f} s after its start (load {st.load_s:.2f} s, warm-up of "
            f"{row['lanes_online']} of {st.lanes} lane(s) {st.warmup_s:.2f} s, capacity {st.capacity} of "
            f"{row['capacity_full']}, process and imports {row['process_and_imports_s']:.2f} s); "
            f"GPU used {row['gpu_used_mib']} MiB; load: " + ", ".join(
                f"{k} {v:.2f}" for k, v in row["load_split"].items() if k.endswith("_s")))
        return row

    @staticmethod
    def to_all_lanes(row: dict[str, Any]) -> float | None:
        """Actor start to every lane captured (``None`` while some still capture)."""
        if row["lanes_ready_s"] is None:
            return None
        return row["spawn_to_ready_s"] - row["ready_s"] + row["lanes_ready_s"]

    def all_lanes(self, name: str, early: bool = True, timeout: float | None = None) -> None:
        """A worker that joined with lanes still capturing: one conversation streamed on it while they
        capture (``early``: each chunk's latency, the lanes online after it), until ``--early-chunks``
        or every lane is online; then every lane waited for (``wait_lanes``), and the capacity the
        controller admits once it has seen them."""
        a, row = self.args, self.report["ready"][name]
        if row["lanes_online"] >= row["lanes"]:
            return
        handle = self.handles[name]
        if early and a.early_chunks:
            s = self.stream(f"early-{name}", EARLY)
            s.open(name)
            lat, online = [], []
            for _ in range(a.early_chunks):
                _res, t = s.step()
                lat.append(t)
                online.append(self.get(handle.status.remote()).lanes_online)
                if online[-1] >= row["lanes"]:
                    break
            s.close()
            row["early"] = {"latency": ms(lat), "latency_s": lat, "lanes_online_after": online,
                            "exact": s.verdict()["exact"]}
            log(f"{name}: {len(lat)} chunk(s) while its lanes captured: latency p50 {pct(lat, 50) * 1e3:.2f} / max "
                f"{max(lat) * 1e3:.2f} ms, lanes online {online[0]} .. {online[-1]}, exact {row['early']['exact']}")
        timeout = timeout or a.start_timeout
        t = time.perf_counter()
        try:
            st = self.get(handle.wait_lanes.remote(timeout), timeout=timeout + 30)
        except Exception as e:
            row["warmup_error"] = f"{type(e).__name__}: {e}"[-2000:]
            self.save()
            raise
        row.update(wait_lanes_s=time.perf_counter() - t, lanes_online_all=st.lanes_online,
                   capacity_all_lanes=st.capacity, lanes_ready_s=st.lanes_ready_s, warmup_error=st.warmup_error)
        row["spawn_to_all_lanes_s"] = self.to_all_lanes(row)
        deadline = time.perf_counter() + 30  # the controller's own wait ends about when this one did
        while True:
            view = self.get(self.ctl.status.remote())["workers"][name]
            if view["capacity"] >= st.capacity or time.perf_counter() > deadline:
                break
            time.sleep(0.05)
        row["controller_capacity_all_lanes"] = view["capacity"]
        log(f"{name}: every lane online {row['lanes_ready_s'] or math.nan:.2f} s after its construction, "
            f"{row['spawn_to_all_lanes_s'] or math.nan:.2f} s after its start (serving from "
            f"{row['spawn_to_ready_s']:.2f} s); "
            f"the controller admits {view['capacity']} of {st.capacity}")

    def start_workers(self) -> None:
        """worker-0, then worker-1 (each ready time alone), or both at once (``--parallel-start``); each
        one's lanes still capturing then streamed on and waited for (:meth:`all_lanes`)."""
        if not self.args.parallel_start:
            self.add_worker("worker-0")
            self.all_lanes("worker-0")
            self.add_worker("worker-1")
            self.all_lanes("worker-1")
            return
        refs = {n: self.ctl.add_worker.remote(self.worker_config(), n, self.worker_options())
                for n in ("worker-0", "worker-1")}
        for n, ref in refs.items():
            self.add_worker(n, ref)
        for n in refs:
            self.all_lanes(n)

    def routing(self) -> None:
        a, m = self.args, self.model
        r = self.stream("routing", ROUTED)
        r.open("worker-0")
        for _ in range(a.warm):
            r.step()
        lat, added, call = [], [], []
        for _ in range(a.chunks):
            res, t = r.step()
            lat.append(t)
            added.append(t - res.call_s)
            call.append(res.call_s)
        # straight to a worker's handle: one hop, no journal (what the controller's hop costs beside it)
        worker = self.handles["worker-1"]
        self.get(worker.open.remote("direct", DIRECT, self.prompt_ref))
        dlat, dadded, douts = [], [], {}
        for k in range(a.warm + a.chunks):
            t = time.perf_counter()
            res = self.get(worker.step.remote("direct", k, m.chunk(DIRECT, k)))
            douts[k] = tuple(res.outputs)
            if k >= a.warm:
                dlat.append(time.perf_counter() - t)
                dadded.append(dlat[-1] - res.call_s)
        self.get(worker.close.remote("direct"))
        # through a router in this process (what the front end's replicas use): one hop, the journal
        # here, a checkpoint asked for every K chunks and not waited for
        from cadence_fx.serve.router import Router

        self.router = Router(self.ctl)
        rs = RoutedStream(self, "router", ROUTER, self.router)
        self.streams.append(rs)
        rs.open("worker-1")
        rlat, radded = [], []
        for k in range(a.warm + a.chunks):
            res, t = rs.step()
            if k >= a.warm:
                rlat.append(t)
                radded.append(t - res.call_s)
        rs.close()
        self.direct = {"chunks": a.warm + a.chunks, "sha256": _digest([douts[k] for k in sorted(douts)]),
                       "solo_sha256": m.solo_digest(DIRECT, a.warm + a.chunks)}
        self.direct["exact"] = self.direct["sha256"] == self.direct["solo_sha256"]
        # an empty call to each (the first 10 not counted): Ray's floor per hop
        floor = {what: ms([self.timed_call(method) for _ in range(a.chunks + 10)][10:])
                 for what, method in (("worker", worker.ping), ("controller", self.ctl.ping))}
        local = m.solo_call_s[ROUTED][a.warm:a.warm + a.chunks]
        status = self.get(self.ctl.status.remote())
        self.report["routing"] = {
            "latency": ms(lat), "added": ms(added), "worker_call": ms(call), "in_process": ms(local),
            "latency_over_in_process_ms": {"p50": (pct(lat, 50) - pct(local, 50)) * 1e3,
                                           "p99": (pct(lat, 99) - pct(local, 99)) * 1e3},
            "direct_latency": ms(dlat), "direct_added": ms(dadded), "ping": floor,
            "router_latency": ms(rlat), "router_added": ms(radded), "router_stats": dict(self.router.stats),
            "controller_overhead": status["metrics"].get("routing")}
        r.close()  # the victim of the failover holds only the failover's conversations
        ro = self.report["routing"]
        log(f"routing: latency p50 {ro['latency']['p50_ms']:.2f} / p99 {ro['latency']['p99_ms']:.2f} ms; added p50 "
            f"{ro['added']['p50_ms']:.2f} / p99 {ro['added']['p99_ms']:.2f} ms; router added p50 "
            f"{ro['router_added']['p50_ms']:.2f} / p99 {ro['router_added']['p99_ms']:.2f} ms; direct added p50 "
            f"{ro['direct_added']['p50_ms']:.2f} / p99 {ro['direct_added']['p99_ms']:.2f} ms; in-process p50 "
            f"{ro['in_process']['p50_ms']:.2f} ms")

    def migration_and_checkpoints(self) -> None:
        a = self.args
        mv = self.stream("mover", MOVER)
        mv.open("worker-0")
        for _ in range(a.warm + 1):  # until the state has its longest extent (the trims fire)
            mv.step()
        # the controller's own choice first (on the device: both workers share the GPU), then forced
        # through the object store (what a move to another GPU or host costs)
        moves, walls, nbytes, paths, host_moves = [], [], 0, [], []
        for i in range(2 * a.moves):
            via = "auto" if i < a.moves else "host"
            t = time.perf_counter()
            rep = self.get(self.ctl.migrate.remote("mover", f"worker-{(i + 1) % 2}", via=via))
            (moves if via == "auto" else host_moves).append(rep.seconds)
            if via == "auto":
                walls.append(time.perf_counter() - t)
                paths.append(rep.path)
            nbytes = rep.nbytes
            mv.step()
        self.report["state_bytes"] = nbytes
        self.report["migration"] = {**ms(moves), "client_wall": ms(walls), "bytes": nbytes, "paths": paths,
                                    "mib": nbytes / 2**20, "gb_per_s": nbytes / pct(moves, 50) / 1e9 if moves else None,
                                    "host": ms(host_moves),
                                    "fallbacks": self.get(self.ctl.status.remote())["metrics"].get("counters", {})
                                    .get("handoff_fallback", 0)}
        log(f"migration ({', '.join(sorted(set(paths)))}): p50 {pct(moves, 50) * 1e3:.1f} ms, max "
            f"{max(moves, default=math.nan) * 1e3:.1f} ms for {nbytes / 2**20:.1f} MiB of state; through the host p50 "
            f"{pct(host_moves, 50) * 1e3:.1f} ms")
        self.save()
        ckpt: dict[str, list[float]] = {"controller": [], "worker": []}
        export, chunk_worker, chunk_wall = [], [], []
        for _ in range(a.checkpoints):
            for store, times in ckpt.items():
                t = time.perf_counter()
                self.get(self.ctl.checkpoint.remote("mover", store))
                times.append(time.perf_counter() - t)
            holder = self.handles[self.get(self.ctl.affinity.remote())["mover"]]
            # the worker's export alone; the state stays in the worker's object store and is dropped
            _state, meta = holder.checkpoint.options(num_returns=2).remote("mover")
            export.append(float(self.get(meta)["export_s"]))
            del _state
            res, t = mv.step()
            chunk_worker.append(res.worker_s)
            chunk_wall.append(t)
        mv.close()
        w50, c50, k = pct(chunk_worker, 50), pct(chunk_wall, 50), a.every

        def cost(x: float, per: float) -> float | None:
            return 100.0 * x / (k * per) if per > 0 and k > 0 else None

        def k5(x: float, per: float) -> int | None:
            return math.ceil(x / (0.05 * per)) if per > 0 else None

        e50, cc50, cw50 = pct(export, 50), pct(ckpt["controller"], 50), pct(ckpt["worker"], 50)
        self.report["checkpoint"] = {
            "controller_store": ms(ckpt["controller"]), "worker_store": ms(ckpt["worker"]), "export": ms(export),
            "chunk_worker": ms(chunk_worker), "chunk_latency": ms(chunk_wall), "bytes": nbytes, "every": k,
            # what a checkpoint takes from the worker's capacity: its export against the K chunks' worker time
            "pct_worker_time_at_k": cost(e50, w50),
            # its wall time (after the reply, between chunks) against the K chunks' client latency
            "pct_wall_at_k_controller_store": cost(cc50, c50), "pct_wall_at_k_worker_store": cost(cw50, c50),
            "k_for_5pct_worker_time": k5(e50, w50), "k_for_5pct_wall_controller_store": k5(cc50, c50),
            "k_for_5pct_wall_worker_store": k5(cw50, c50)}
        ck = self.report["checkpoint"]
        log(f"checkpoint: controller store p50 {cc50 * 1e3:.1f} ms, worker store {cw50 * 1e3:.1f} ms, export "
            f"{e50 * 1e3:.1f} ms against a {w50 * 1e3:.1f} ms chunk: {ck['pct_worker_time_at_k']:.2f} % of the worker's "
            f"time at K={k}")

    def failover(self) -> None:
        import ray

        a = self.args
        victim, survivor = "worker-0", "worker-1"
        convs = [self.stream(f"f{i}", s) for i, s in enumerate(FAILOVER)]
        for c, w in zip(convs, (victim, victim, survivor)):
            c.open(w)

        def round_() -> list[tuple[Stream, Any, float]]:
            return [(c, c.send(), time.perf_counter()) for c in convs]

        for _ in range(a.warm):
            for c, sent, _t in round_():
                c.receive(sent)
        for c in convs:  # a checkpoint, then half a period of journal to re-run
            self.get(self.ctl.checkpoint.remote(c.conv))
        for _ in range(a.every // 2):
            for c, sent, _t in round_():
                c.receive(sent)
        pid = self.get(self.handles[victim].pid.remote())
        busy = self.get(self.ctl.status.remote())["workers"][victim]
        sent = round_()
        time.sleep(a.kill_after_ms / 1e3)  # the victim is computing the round's chunks
        t_kill = time.perf_counter()
        if a.kill == "sigkill":
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(self.handles[victim], no_restart=True)
        after: dict[str, float] = {}
        served_by: dict[str, str] = {}
        for c, s, _t in sent:
            res = c.receive(s)
            after[c.conv] = time.perf_counter() - t_kill
            served_by[c.conv] = res.worker
        for _ in range(3):
            for c, s, _t in round_():
                c.receive(s)
        on_victim = [c.conv for c in convs[:2]]
        resumes = [x for x in self.get(self.ctl.resumes.remote()) if x["from"] == victim and x["conv_id"] in on_victim]
        self.report["failover"] = {
            "kill": a.kill, "kill_after_ms": a.kill_after_ms, "journal_chunks": a.every // 2,
            "victim_conversations_before": busy["conversations"],
            "kill_to_next_chunk_s": {c: after[c] for c in on_victim},
            "survivor_chunk_during_failover_s": after[convs[2].conv],
            "served_by": served_by, "resumes": resumes,
            "resume_s": [x["resume_s"] for x in resumes], "replayed": [x["replayed"] for x in resumes],
            "max_kill_to_next_chunk_s": max(after[c] for c in on_victim)}
        fo = self.report["failover"]
        log(f"failover ({a.kill}): kill to next chunk {', '.join(f'{c} {after[c]:.3f} s' for c in on_victim)}; "
            f"resumes {[round(x, 3) for x in fo['resume_s']]} s re-running {fo['replayed']} chunks")
        self.save()
        if a.replacement:
            if self.left() < a.replacement_needs_s:
                self.report["skipped"].append(f"replacement worker: {self.left():.0f} s left of the time budget")
                return
            row = self.add_worker("worker-2")
            t = time.perf_counter()
            rep = self.get(self.ctl.migrate.remote(convs[0].conv, "worker-2"))
            for _ in range(2):
                for c, s, _t in round_():
                    c.receive(s)
            fo["replacement"] = {"ready": row, "migrate_onto_s": rep.seconds, "wall_s": time.perf_counter() - t}
            try:  # its lanes still capturing, if any (the migration above went onto the lanes online)
                self.all_lanes("worker-2", early=False, timeout=max(5.0, min(a.start_timeout, self.left() - 20)))
            except Exception as e:  # what was measured stands; the report says why the rest is missing
                log(f"worker-2: not every lane online ({e!r})")

    def verdicts(self) -> None:
        streams = {s.conv: s.verdict() for s in self.streams}
        if hasattr(self, "direct"):
            streams["direct"] = {**self.direct, "lost": 0, "answered_twice": 0}
        self.report["streams"] = streams
        self.report["exact"] = bool(streams) and all(v["exact"] for v in streams.values())
        self.report["lost_chunks"] = sum(v["lost"] for v in streams.values())
        self.report["answered_twice"] = sum(v["answered_twice"] for v in streams.values())
        each = ", ".join(f"{c}: {v['exact']}" for c, v in streams.items())
        log(f"exact: {self.report['exact']} over {len(streams)} streams ({each}); lost {self.report['lost_chunks']}, "
            f"answered twice {self.report['answered_twice']}")

    def targets(self) -> None:
        r = self.report
        t: dict[str, Any] = {}
        if r.get("ready"):
            w0 = r["ready"].get("worker-0", {})
            first = w0.get("spawn_to_ready_s")  # to serving (with --serve-from-lanes: its first lanes)
            t["worker_ready_le_20s"] = {"value_s": first, "met": first is not None and first <= 20,
                                        "spawn_to_all_lanes_s": w0.get("spawn_to_all_lanes_s")}
        if "routing" in r:  # the front end's path: the router's one hop
            v = r["routing"]["router_added"]["p99_ms"]
            t["routing_added_p99_le_2ms"] = {"value_ms": v, "met": v <= 2, "through_controller_ms":
                                             r["routing"]["added"]["p99_ms"]}
            t["routing_added_p99_le_5ms"] = {"value_ms": v, "met": v <= 5}
        if "migration" in r:
            v = r["migration"]["p50_ms"]
            t["migration_le_100ms"] = {"value_ms": v, "bytes": r["migration"]["bytes"], "met": v <= 100}
        if "failover" in r:
            v = r["failover"]["max_kill_to_next_chunk_s"]
            t["failover_le_3s_nothing_lost_identical"] = {
                "value_s": v, "met": v <= 3 and r.get("lost_chunks") == 0 and r.get("answered_twice") == 0
                and all(r.get("streams", {}).get(c, {}).get("exact") for c in ("f0", "f1", "f2"))}
        if "checkpoint" in r:
            v = r["checkpoint"]["pct_worker_time_at_k"]
            t["checkpoint_le_5pct_capacity"] = {"value_pct": v, "every": r["checkpoint"]["every"],
                                                "met": v is not None and v <= 5}
        r["targets"] = t

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for h in self.handles.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        if self.args.ray_logs:
            _copy_ray_logs(Path(self.args.ray_logs))
        ray.shutdown()


def _object_store_bytes(want: int) -> tuple[int, str]:
    """The object store's size and where it lives: ``want`` in /dev/shm where it has room, else what
    /dev/shm has (from 8 GiB: a released-size conversation's state is about 0.4-0.6 GiB, its prompt
    0.6 GiB), else ``want`` on the disk (Ray refuses a store over 10 GB that /dev/shm cannot hold unless
    told slow storage is allowed)."""
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    if free >= want:
        return want, "/dev/shm"
    if free >= 8 << 30:
        return int(free * 0.9), f"/dev/shm (it has {free / 2**30:.1f} GiB free)"
    os.environ["RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE"] = "1"
    return want, f"{tempfile.gettempdir()} (/dev/shm has {free / 2**30:.1f} GiB free)"


def _gpu_used_mib() -> int | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int((total - free) / 2**20)


def _copy_ray_logs(dest: Path, per_file: int = 256 << 10, total: int = 8 << 20) -> None:
    """The tails of this Ray session's non-empty logs (workers, raylet, GCS): what to read when a worker
    failed on a machine that is gone after the call."""
    try:
        import ray

        logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"  # type: ignore[attr-defined]
    except Exception:
        logs = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"
    if not logs.is_dir():
        return
    dest.mkdir(parents=True, exist_ok=True)
    used = 0
    files = sorted((p for p in logs.iterdir() if p.is_file() and p.stat().st_size > 0),
                   key=lambda p: (not p.name.endswith(".err"), p.name))
    for p in files:
        if used >= total:
            break
        size = p.stat().st_size
        with p.open("rb") as fh:
            fh.seek(max(0, size - per_file))
            data = fh.read()
        (dest / p.name).write_bytes(data)
        used += len(data)


def _watchdog(bench: Bench, deadline: float) -> None:
    """At ``deadline`` seconds from this process's start: the report as it stands (``error: deadline``),
    the Ray logs copied, this node's Ray processes ended, and exit 124, so that a device call's output
    comes back before the call's own limit ends it with nothing written."""
    import threading

    def fire() -> None:
        log(f"DEADLINE: {deadline:.0f} s reached; writing what was measured and stopping")
        bench.report["error"] = f"deadline: stopped at {deadline:.0f} s, in phase {bench.report.get('phase_running')}"
        try:
            bench.targets()
            bench.save()
            if bench.args.ray_logs:
                _copy_ray_logs(Path(bench.args.ray_logs))
            import ray

            node = ray._private.worker._global_node
            if node is not None:
                node.kill_all_processes(check_alive=False, allow_graceful=False)
        finally:
            os._exit(124)

    timer = threading.Timer(max(1.0, deadline - (time.perf_counter() - T_START)), fire)
    timer.daemon = True
    timer.start()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (the CPU smoke test)")
    ap.add_argument("--model", default="token2wav", choices=("token2wav", "demo"),
                    help="demo: the demo decoder instead of Token2Wav, on the CPU (the quick smoke: tests/)")
    ap.add_argument("--lanes", type=int, default=None, help="lanes per worker (default 8 on a GPU, 1 on the CPU)")
    ap.add_argument("--worker-gpus", type=float, default=None, help="GPU share per worker (default 0.5 on a GPU)")
    ap.add_argument("--worker-cpus", type=float, default=0.5)
    ap.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the Ray head (default: os.cpu_count())")
    ap.add_argument("--object-store-gib", type=float, default=None, help="default 24 on a GPU, 0.5 on the CPU")
    ap.add_argument("--capacity", type=int, default=8, help="conversations per worker (given: no calibration)")
    ap.add_argument("--serve-from-lanes", type=int, default=None,
                    help="a worker serves once this many lanes are captured, the others capture in the background "
                         "(default: every lane before it is ready)")
    ap.add_argument("--early-chunks", type=int, default=16,
                    help="chunks streamed on a worker while its lanes capture (with --serve-from-lanes)")
    ap.add_argument("--warm", type=int, default=4, help="chunks before a stream is measured, moved or checkpointed")
    ap.add_argument("--chunks", type=int, default=None, help="routed chunks measured (default 100; 8 reduced)")
    ap.add_argument("--moves", type=int, default=None, help="migrations (default 10; 2 reduced)")
    ap.add_argument("--checkpoints", type=int, default=None, help="checkpoints of each store (default 10; 2 reduced)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint interval K (default 16; 4 reduced)")
    ap.add_argument("--store", default="controller", choices=("controller", "worker"),
                    help="where the policy's checkpoints live (the failover's base)")
    ap.add_argument("--kill", default="sigkill", choices=("sigkill", "ray"))
    ap.add_argument("--kill-after-ms", type=float, default=None,
                    help="from sending the round to the kill (default: a third of the in-process chunk p50)")
    ap.add_argument("--parallel-start", action="store_true",
                    help="start the two workers at once (their ready times then overlap; quicker)")
    ap.add_argument("--replacement", action=argparse.BooleanOptionalAction, default=True,
                    help="after the failover, a new worker joins and takes a conversation")
    ap.add_argument("--stock-chunks", type=int, default=4, help="chunks of the stock step the solo run is checked "
                                                                "against (0: none)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds from the start (default 440 on a GPU, none on the CPU); the replacement worker is "
                         "skipped when less than a minute is left")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start (default 520 on a GPU, none on the CPU): write the report, end Ray, "
                         "exit 124 (0: none)")
    ap.add_argument("--call-timeout", type=float, default=300.0, help="seconds any one Ray call may take")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds a worker may take to be ready")
    ap.add_argument("--worker-logs", action=argparse.BooleanOptionalAction, default=True,
                    help="Ray workers' output on this process's (log_to_driver)")
    ap.add_argument("--ray-logs", default=None, help="copy the Ray session's logs (tails) here at the end")
    ap.add_argument("--dir", default=None, help="where the artifact goes (default: a temporary folder, removed)")
    ap.add_argument("--json", default=None, help="the report (rewritten after every phase)")
    args = ap.parse_args(argv)
    small = args.reduced or args.model == "demo"
    args.device = "cuda" if torch.cuda.is_available() and not small else "cpu"
    args.dtype = "float32"  # benchmarks.cadence_model's build_bench reads it (fp32 only here)
    gpu = args.device == "cuda"
    args.replay = "auto" if gpu else "off"
    args.lanes = args.lanes or (8 if gpu else 1)
    args.worker_gpus = (0.5 if gpu else 0.0) if args.worker_gpus is None else args.worker_gpus
    args.ray_cpus = args.ray_cpus or max(2, os.cpu_count() or 2)
    args.object_store_gib = args.object_store_gib or (24.0 if gpu else 0.5)
    args.chunks = args.chunks or (8 if small else 100)
    args.moves = args.moves if args.moves is not None else (2 if small else 10)
    args.checkpoints = args.checkpoints if args.checkpoints is not None else (2 if small else 10)
    args.every = args.every or (4 if small else 16)
    args.warming = args.serve_from_lanes is not None and args.serve_from_lanes < args.lanes
    args.max_chunks = max(args.warm + args.chunks, args.warm + 1 + 2 * args.moves + args.checkpoints,
                          args.warm + args.every // 2 + 6, args.early_chunks if args.warming else 0)
    args.replacement_needs_s = 60.0 if gpu else 30.0
    args.time_budget = args.time_budget if args.time_budget is not None else (440.0 if gpu else math.inf)
    args.deadline = args.deadline if args.deadline is not None else (520.0 if gpu else 0.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cpu":  # the workers' setting (WorkerConfig.threads): one reduction order everywhere
        torch.set_num_threads(1)
    bench = Bench(args)
    if args.deadline:
        _watchdog(bench, args.deadline)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cadence_fx_serve_"))
    folder.mkdir(parents=True, exist_ok=True)
    status = 1
    try:
        bench.phase("build", lambda: bench.build(folder))
        if args.kill_after_ms is None:
            args.kill_after_ms = bench.report["solo"]["in_process"]["p50_ms"] / 3
        bench.phase("ray", bench.start_ray)
        bench.phase("ready", bench.start_workers)
        bench.phase("routing", bench.routing)
        bench.phase("migration_checkpoint", bench.migration_and_checkpoints)
        bench.phase("failover", bench.failover)
        bench.verdicts()
        status = 0 if bench.report["exact"] else 1
    except BaseException as e:  # the report says where it stopped; the Ray logs are copied below
        bench.report["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-6000:]
        log(f"FAILED: {e!r}")
        if bench.streams:
            try:
                bench.verdicts()
            except Exception:
                pass
    finally:
        bench.targets()
        bench.save()
        try:
            bench.shutdown()
        except Exception as e:
            log(f"shutdown: {e!r}")
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"targets": bench.report.get("targets"), "exact": bench.report.get("exact"),
                      "lost_chunks": bench.report.get("lost_chunks"), "wall_s": time.perf_counter() - T_START}),
          flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
