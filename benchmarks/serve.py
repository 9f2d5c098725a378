"""Serving on Ray, measured: worker time to ready, routing overhead, migration, checkpoint, resume after a kill.

    python benchmarks/serve.py --json docs/results/serve-cpu.json           # CPU: the demo decoder, small sizes
    python benchmarks/serve.py --address auto --worker-gpus 1 --replay auto \\
        --artifact token2wav.cfx --sha256 <digest> --json serve-h200.json    # GPUs, a released artifact

Per state size (``--sizes dim:keep,...``: the demo decoder with ``dim`` channels keeping ``keep`` + ``keep``
frames of history, exported, optimized and saved once each; or ``--artifact``, whose chunks are zeros of
its first class's shapes, with no exactness gate), a controller and two workers loaded from the artifact
(on two nodes of a local ``ray.cluster_utils.Cluster`` unless ``--address``):

- ``ready``: worker start to ready (process, imports, ``cf.load``, warm-up; capacity from the config);
- ``routing``: ``--chunks`` chunks of one conversation, one after another, through the controller:
  client latency per chunk, and the overhead it adds per chunk over the in-process cost of the same
  chunk (the session call with its outputs on the host, timed inside the worker: ``StepResult.call_s``),
  p50/p99; ``router``: the same through a ``Router`` in this process (one hop to the worker, the
  journal kept here, checkpoints asked for every K chunks without waiting, latencies reported in
  batches: the one-hop path); ``direct``: the same to the worker's handle without the controller
  (one hop, no journal, no checkpoints); ``ping``: an actor call that does nothing, to the worker and
  to the controller (Ray's floor per hop on this machine, p50 and p99); ``local``: the session call in
  this process (demo sizes only);
- ``migration``: ``--moves`` moves of a live conversation between the two workers (export, object
  store, import, close), with a chunk between each, p50 seconds and the state's bytes;
- ``checkpoint``: ``--checkpoints`` checkpoints of each store (``controller``: export, transfer,
  ``ray.put`` by the controller; ``worker``: left in the worker node's object store), and the worker's
  export alone, against the chunk's worker time: the K at which a checkpoint's wall time is at most
  5 % of the chunks' between two (``k_for_5pct``), and the K at which the worker's export takes at
  most 5 % of its time on the conversation (``k_for_5pct_worker_time``: what it costs capacity);
- ``resume``: per kill in ``--kills`` (``ray`` for ``ray.kill``, ``sigkill`` for ``SIGKILL`` of the
  worker's process), two conversations on the victim with chunks in the journal since their last
  checkpoint: kill to the first chunk answered afterwards (detection, resume, re-run, the chunk), and
  the controller's resume seconds; then a replacement worker joins.

Every stream of the demo (the migrated conversation, the resumed ones) is checked bit for bit against
its solo run through the unmodified exported programs (``exact``). On the CPU the figures are the
CPU's (2 cores shared by the driver, the controller, the workers and Ray's own processes).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

import cadence_fx as cf  # noqa: E402
from benchmarks import harness  # noqa: E402
from cadence_fx.determinism import sha256_tensors  # noqa: E402
from cadence_fx.serve.checkpoints import CheckpointPolicy  # noqa: E402
from cadence_fx.serve import wire  # noqa: E402
from cadence_fx.serve.controller import ControllerConfig, start_controller  # noqa: E402
from cadence_fx.serve.router import Router  # noqa: E402
from cadence_fx.serve.worker import WorkerConfig  # noqa: E402
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog  # noqa: E402

pct = harness.percentile


class Model:
    """What the client sends and what the stream must equal: the demo (inputs seeded per conversation,
    a reference) or an artifact known only by its shapes (zeros, no reference)."""

    def __init__(self, path: str, sha: str, *, cfg: DemoConfig | None = None, eps: Any = None,
                 model: StreamingDecoder | None = None, example: Any = None) -> None:
        self.path, self.sha, self.cfg, self.eps, self.model, self.example = path, sha, cfg, eps, model, example

    def prompt(self, seed: int) -> Any:
        if self.model is None:
            return self.example[1]
        return [s + seed * 0.01 for s in self.model.initial_state()]

    def chunk(self, seed: int, k: int) -> list[torch.Tensor]:
        if self.cfg is None:
            return list(self.example[0].values())
        g = torch.Generator().manual_seed(seed * 1000 + k)
        return [torch.randn(1, self.cfg.chunk, self.cfg.dim, generator=g) for _ in range(2)]

    def warm_chunks(self, given: int | None) -> int:
        """Chunks until the demo's state stops growing (its extent reaches head + tail)."""
        if given is not None or self.cfg is None:
            return given or 1
        return max(1, math.ceil((self.cfg.head + self.cfg.tail - self.cfg.prompt) / self.cfg.chunk) + 1)

    def solo(self, seed: int, chunks: int) -> str | None:
        if self.eps is None:
            return None
        ref, state, frames = cf.reference(self.eps), self.prompt(seed), []
        for k in range(chunks):
            tok, noise = self.chunk(seed, k)
            out = ref(tok, *state, noise)
            frames.append(out[0].clone())
            state = [t.clone() for t in out[1:]]
        return sha256_tensors(frames)


def demo_model(dim: int, keep: int, folder: Path) -> Model:
    cfg = DemoConfig(dim=dim, head=keep, tail=keep, capacity=2 * keep + 8, prompt=min(8, 2 * keep))
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval()
    contract = demo_contract(cfg)
    eps = export_catalog(model, contract)
    path = folder / f"demo-{dim}-{keep}.cfx"
    info = cf.save(cf.optimize(eps, contract, replay="off"), path)
    return Model(str(path), info["sha256"], cfg=cfg, eps=eps, model=model)


class Client:
    """One conversation's client: sends its chunks in order, keeps its frames."""

    def __init__(self, ctl: Any, model: Model, conv: str, seed: int) -> None:
        self.ctl, self.model, self.conv, self.seed, self.k, self.frames = ctl, model, conv, seed, 0, []

    def open(self, worker: str | None = None) -> dict:
        return ray.get(self.ctl.open.remote(self.conv, seed=self.seed, prompt=self.model.prompt(self.seed),
                                            worker=worker))

    def send(self) -> Any:
        ref = self.ctl.step.remote(self.conv, self.k, self.model.chunk(self.seed, self.k))
        self.k += 1
        return ref

    def receive(self, ref: Any) -> Any:
        res = ray.get(ref)
        self.frames.append(res.outputs[0])
        return res

    def step(self) -> tuple[Any, float]:
        t0 = time.perf_counter()
        res = self.receive(self.send())
        return res, time.perf_counter() - t0

    def exact(self) -> bool | None:
        want = self.model.solo(self.seed, self.k)
        return None if want is None else sha256_tensors(self.frames) == want

    def timed(self, warm: int, chunks: int) -> tuple[list[float], list[float], list[float]]:
        """``warm`` untimed chunks, then ``chunks`` timed: latencies, what each added over the chunk's
        in-process cost (the session call with its outputs on the host, timed in the worker), and the
        worker's own time outside that call (its sequence check, the chunk's layout, the digest)."""
        for _ in range(warm):
            self.step()
        lat, added, inside = [], [], []
        for _ in range(chunks):
            res, t = self.step()
            lat.append(t)
            added.append(t - res.call_s)
            inside.append(res.worker_s - res.call_s)
        return lat, added, inside


class RoutedClient(Client):
    """One conversation's client through a :class:`Router` in this process: one hop per chunk."""

    def __init__(self, router: Router, model: Model, conv: str, seed: int) -> None:
        super().__init__(router.controller, model, conv, seed)
        self.router = router

    def open(self, worker: str | None = None) -> dict:
        return self.router.open(self.conv, seed=self.seed, prompt=self.model.prompt(self.seed), worker=worker)

    def step(self) -> tuple[Any, float]:
        t0 = time.perf_counter()
        res = self.router.step(self.conv, self.k, self.model.chunk(self.seed, self.k))
        self.k += 1
        self.frames.append(res.outputs[0])
        return res, time.perf_counter() - t0


def ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3, "n": len(xs)}


def run_size(model: Model, args: argparse.Namespace, index: int) -> dict[str, Any]:
    wcfg = WorkerConfig(model.path, sha256=model.sha, lanes=args.lanes, replay=args.replay, capacity=args.capacity,
                        threads=args.threads)
    opts = {"num_gpus": args.worker_gpus, "num_cpus": args.worker_cpus, "scheduling_strategy": "SPREAD"}
    ccfg = ControllerConfig(checkpoint=CheckpointPolicy(every=args.every), health_interval_s=0.5)
    t0 = time.perf_counter()
    ctl = start_controller([wcfg, wcfg], config=ccfg, worker_options=opts, name=f"serve-bench-{index}")
    row: dict[str, Any] = {"start_s": time.perf_counter() - t0}
    st = ray.get(ctl.status.remote())["workers"]
    row["ready"] = {n: {"spawn_to_ready_s": w["spawn_to_ready_s"], "ready_s": w["ready_s"]} for n, w in st.items()}
    handles = {n: ray.get(ctl.worker_handle.remote(n)) for n in st}
    if model.cfg is None:
        model.example = ray.get(handles["worker-0"].example.remote())

    # routing: one conversation's chunks in order, through the controller, through a router (one hop)
    # and straight to a worker's handle
    r = Client(ctl, model, "routing", 1)
    r.open("worker-0")
    lat, added, _inside = r.timed(10, args.chunks)
    routed = RoutedClient(Router(ctl), model, "routed", 4)
    routed.open("worker-1")
    rlat, radded, rinside = routed.timed(10, args.chunks)
    worker = handles["worker-1"]
    ray.get(worker.open.remote("direct", 2, model.prompt(2)))
    dlat, dadded = [], []
    for k in range(args.chunks + 10):
        t = time.perf_counter()
        res = ray.get(worker.step.remote("direct", k, model.chunk(2, k)))
        if k >= 10:
            dlat.append(time.perf_counter() - t)
            dadded.append(dlat[-1] - res.call_s)
    ray.get(worker.close.remote("direct"))
    floor = {}
    for what, call in (("worker", worker.ping), ("controller", ctl.ping)):
        ts = []
        for i in range(args.chunks + 10):
            t = time.perf_counter()
            ray.get(call.remote())
            if i >= 10:
                ts.append(time.perf_counter() - t)
        floor[what] = ms(ts)
    row["routing"] = {"latency": ms(lat), "added": ms(added), "direct_latency": ms(dlat), "direct_added": ms(dadded),
                      "router_latency": ms(rlat), "router_added": ms(radded), "worker_outside_call": ms(rinside),
                      "ping": floor,
                      "controller_overhead": ray.get(ctl.status.remote())["metrics"]["routing"],
                      "router_overhead": ray.get(ctl.status.remote())["metrics"]["routing_router"],
                      "local": local_baseline(model, args) if model.eps is not None and args.local else None}

    # migrations and checkpoints of one live conversation
    warm = model.warm_chunks(args.warm)
    m = Client(ctl, model, "mover", 3)
    m.open("worker-0")
    for _ in range(warm):  # until the state has its longest extent (the retention's head + tail)
        m.step()
    moves, nbytes = [], 0
    for i in range(args.moves):
        rep = ray.get(ctl.migrate.remote("mover", f"worker-{(i + 1) % 2}"))
        moves.append(rep.seconds)
        nbytes = rep.nbytes
        m.step()
    ckpt: dict[str, list[float]] = {"controller": [], "worker": []}
    export, chunk_s = [], []
    for _ in range(args.checkpoints):
        for store, times in ckpt.items():
            t = time.perf_counter()
            ray.get(ctl.checkpoint.remote("mover", store))
            times.append(time.perf_counter() - t)
        holder = handles[ray.get(ctl.affinity.remote())["mover"]]
        export.append(ray.get(holder.export_conversation.remote("mover")).meta["export_s"])
        res, _t = m.step()
        chunk_s.append(res.worker_s)
    w50 = pct(chunk_s, 50)
    row["state_bytes"] = nbytes
    row["migration"] = {**ms(moves), "bytes": nbytes}
    row["checkpoint"] = {**ms(ckpt["controller"]), "worker_store": ms(ckpt["worker"]), "export": ms(export),
                         "chunk_worker": ms(chunk_s),
                         # checkpoint wall time at most 5 % of a conversation's chunk time, and the worker's
                         # own export at most 5 % of its time (what a checkpoint takes from its capacity)
                         "k_for_5pct": math.ceil(pct(ckpt["controller"], 50) / (0.05 * w50)) if w50 > 0 else None,
                         "k_for_5pct_worker_time": math.ceil(pct(export, 50) / (0.05 * w50)) if w50 > 0 else None}
    row["exact"] = {"mover": m.exact(), "routing": r.exact(), "routed": routed.exact()}

    # resume after a kill
    row["resume"] = []
    live = ["worker-0", "worker-1"]
    for j, how in enumerate(args.kills):
        victim = live[0]
        clients = [Client(ctl, model, f"k{j}-{i}", 10 + 10 * j + i) for i in range(2)]
        for c in clients:
            c.open(victim)
        for _ in range(warm):
            for c in clients:
                c.step()
        for c in clients:  # a checkpoint, then half a period of journal to re-run
            ray.get(ctl.checkpoint.remote(c.conv))
        for _ in range(args.every // 2):
            for c in clients:
                c.step()
        pid = ray.get(handles[victim].pid.remote())
        t_kill = time.perf_counter()
        if how == "sigkill":
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(handles[victim], no_restart=True)
        refs = [c.send() for c in clients]
        firsts = []
        for c, ref in zip(clients, refs):
            c.receive(ref)
            firsts.append(time.perf_counter() - t_kill)
        for _ in range(3):
            for c in clients:
                c.step()
        resumes = [x for x in ray.get(ctl.resumes.remote()) if x["from"] == victim]
        name = f"worker-{2 + j}"
        t = time.perf_counter()
        ray.get(ctl.add_worker.remote(wcfg, name, opts))
        handles[name] = ray.get(ctl.worker_handle.remote(name))
        live = [live[1], name]
        row["resume"].append({"kill": how, "kill_to_chunk_s": firsts, "resume_s": [x["resume_s"] for x in resumes],
                              "replayed": [x["replayed"] for x in resumes], "replacement_ready_s": time.perf_counter() - t,
                              "exact": [c.exact() for c in clients]})
    for h in handles.values():
        ray.kill(h, no_restart=True)
    ray.kill(ctl)
    return row


def local_baseline(model: Model, args: argparse.Namespace) -> dict[str, float]:
    """The same chunks through a session in this process (``cf.load`` of the same artifact)."""
    prog = cf.load(model.path, sha256=model.sha, replay=args.replay)
    s = prog.session("local", seed=1)
    state = list(s.restore(cf.Snapshot(dict(zip([r.name for r in prog.contract.regions], model.prompt(1))),
                                       None)).values())
    times = []
    for k in range(args.chunks + 10):
        tok, noise = model.chunk(1, k)
        t = time.perf_counter()
        out = s(tok, *state, noise)
        out[0].clone()
        if k >= 10:
            times.append(time.perf_counter() - t)
        state = list(out[1:])
    return ms(times)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["state bytes | ready s | ping worker p50/p99, controller p50 ms | routing p50/p99 ms | added p50/p99 ms "
             "| router added p50/p99 | direct added p50/p99 | migration p50 ms | checkpoint p50 ms ctl/wkr (export) "
             "| chunk ms | K(5%) wall/worker | kill->chunk s | resume s | exact"]
    for r in rows:
        ro, ck = r["routing"], r["checkpoint"]
        ready = max(w["spawn_to_ready_s"] for w in r["ready"].values())
        kills = ", ".join(f"{x['kill']} {max(x['kill_to_chunk_s']):.3f}" for x in r["resume"])
        res = ", ".join(f"{max(x['resume_s'] or [float('nan')]):.3f}" for x in r["resume"])
        exact = all(v is not False for v in r["exact"].values()) and all(
            e is not False for x in r["resume"] for e in x["exact"])
        ping = (f"{ro['ping']['worker']['p50_ms']:.2f}/{ro['ping']['worker']['p99_ms']:.2f}, "
                f"{ro['ping']['controller']['p50_ms']:.2f}")
        lines.append(f"{r['state_bytes']} | {ready:.2f} | {ping} | "
                     f"{ro['latency']['p50_ms']:.2f}/{ro['latency']['p99_ms']:.2f} | "
                     f"{ro['added']['p50_ms']:.2f}/{ro['added']['p99_ms']:.2f} | "
                     f"{ro['router_added']['p50_ms']:.2f}/{ro['router_added']['p99_ms']:.2f} | "
                     f"{ro['direct_added']['p50_ms']:.2f}/{ro['direct_added']['p99_ms']:.2f} | "
                     f"{r['migration']['p50_ms']:.2f} | {ck['p50_ms']:.2f}/{ck['worker_store']['p50_ms']:.2f} "
                     f"({ck['export']['p50_ms']:.2f}) | {ck['chunk_worker']['p50_ms']:.2f} | "
                     f"{ck['k_for_5pct']}/{ck['k_for_5pct_worker_time']} | {kills} | {res} | {exact}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16:8,64:64,128:256,256:512,512:1024", help="demo sizes, dim:keep (comma list)")
    ap.add_argument("--warm", type=int, default=None,
                    help="chunks a conversation runs before it is moved, checkpointed or killed (default: the demo's "
                         "until its state is at its longest; 1 for an artifact)")
    ap.add_argument("--artifact", default=None, help="a saved artifact instead of the demo (zeros as chunks)")
    ap.add_argument("--sha256", default=None)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: a local one)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes of the local cluster (1 CPU each)")
    ap.add_argument("--worker-gpus", type=float, default=0.0)
    ap.add_argument("--worker-cpus", type=float, default=0.5)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--replay", default="off")
    ap.add_argument("--capacity", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (CPU)")
    ap.add_argument("--chunks", type=int, default=300)
    ap.add_argument("--moves", type=int, default=10)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--every", type=int, default=16, help="checkpoint every K chunks")
    ap.add_argument("--kills", default="ray,sigkill")
    ap.add_argument("--no-local", dest="local", action="store_false")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.kills = [k for k in args.kills.split(",") if k]
    torch.set_num_threads(args.threads)
    cluster = None
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 200 << 20,
                                                                "include_dashboard": False})
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=1, object_store_memory=200 << 20)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    wire.install()  # this client's chunks cross as numpy arrays too
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            models: list[Callable[[], Model]]
            if args.artifact:
                models = [lambda: Model(args.artifact, args.sha256)]
            else:
                models = [lambda d=int(d), k=int(k): demo_model(d, k, Path(tmp))
                          for d, k in (s.split(":") for s in args.sizes.split(","))]
            for i, make in enumerate(models):
                rows.append(run_size(make(), args, i))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(table(rows))
    if args.json:
        harness.write_json(args.json, {"device": "cuda" if args.worker_gpus else "cpu", "args": vars(args),
                                       "rows": rows})


if __name__ == "__main__":
    main()
