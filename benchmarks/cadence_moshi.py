"""The Moshi cell of the conversations-per-GPU benchmark (``benchmarks/cadence.py --model moshi``).

A conversation is a Moshi full-duplex stream (``moshi`` 0.2.13, released sizes unless ``--reduced``:
7B temporal transformer + depformer in bf16, Mimi in fp32, random weights built on the GPU from the
benchmark seed). Every ``--period`` (80 ms by default for Moshi) it receives one frame of the user's
audio (1920 samples) and must have the model's frame done: Mimi encodes the user's frame, ``LMGen``
samples the text token and the model's 8 audio codes, Mimi decodes them (from frame ``max_delay`` on).
A conversation follows one of ``--scripts`` scripts: its audio (seeded noise, seed ``10000 + script``,
:func:`~benchmarks.cadence_traffic.script_tokens`) and its sampling seed (``script``: the solo run
seeds ``torch.manual_seed(script)``, a session ``seed=script``). Its bytes are every frame's tokens,
then its PCM where there is any: the SHA-256 of them is the row's per-session digest, the same form
as ``benchmarks/moshi.py``'s ``sha256`` (the stream's tokens and PCM, frame by frame).

What the cadence machinery sees is what it sees of Token2Wav, so every part of it is reused (the
coordinator, the workers' protocol and :func:`~benchmarks.cadence_worker.serve`, the stock rows'
processes, the solo runs, the rows, limits and the gate):

- SRc (:func:`run_worker`): one process per GPU builds the three steps, exports them and optimizes
  each with ``--lanes`` lanes (its own ``CudaGraphBackend``: ``--branches``, ``--blas-streams``),
  frees the upstream modules' copy of the state, warms up (captures) every lane, then serves. A
  conversation is one session of each program (:class:`Conversations`, :class:`Conversation`): its
  frame calls the encode, LM and decode sessions in turn (``cadence_fx.adapters.moshi.step_frame``),
  each session on whichever lane of its program is free; the LM session's random streams are seeded
  with the script's seed, so its sampling is its solo run's whatever runs beside it.
- stock (``benchmarks/cadence_stock.py``, :class:`StockFrame`): the vendor's own serving layout, one
  conversation per process (``moshi/server.py`` holds one ``asyncio.Lock`` per connection): each
  process builds the stack, runs the server's warm-up (4 frames of silence, which captures moshi's
  ``CUDAGraphed`` graphs), and starts its conversation as the server starts a connection
  (``mimi.reset_streaming()``, ``lm_gen.reset_streaming()``), then streams through the stock code
  with moshi's CUDA graphs as shipped (``benchmarks/moshi.py``'s ``vendor`` cell). N processes share
  the GPU.
- solo (``benchmarks/cadence_exact.py``): each script alone through the same stock process
  (``--solo-stock vendor``, the default), or through the eager stock code from the freshly built state
  (``--solo-stock eager``: ``benchmarks/moshi.py``'s ``B0``; about 5x slower per frame on an H200).
  Every session of every row must give its script's solo digest.

Every process runs with ``NO_TORCH_COMPILE=1`` and the determinism envelope (``pin_envelope``), as
``benchmarks/moshi.py`` does: one set of kernels for every cell.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

# before moshi is imported: its torch.compile wrappers read this once, at import
os.environ.setdefault("NO_TORCH_COMPILE", "1")

import torch  # noqa: E402

from benchmarks.cadence_model import child_setup, device_name  # noqa: E402

STAGES = ("encode", "lm", "decode")
SOLO_STOCK = ("vendor", "eager")
#: The server's warm-up (``moshi/server.py``, ``ServerState.warmup``): frames of silence before any connection.
WARMUP_FRAMES = 4


@dataclass
class MoshiBench:
    """What a cadence process needs of Moshi, in the form ``benchmarks.cadence_model.Bench`` has for
    Token2Wav: a step (``fresh``, ``next_args``, ``carry``, ``driver_call``), ``spk`` (unused) and the
    initial state every conversation starts from."""

    step: Any
    spk: Any
    state0: dict
    steps: Any = None  # the three upstream steps (cadence_fx.adapters.moshi.StreamSteps)
    build_s: float = 0.0


def frame_bytes(tokens: torch.Tensor, pcm: torch.Tensor | None) -> torch.Tensor:
    """One frame's bytes as one uint8 tensor: the tokens, then the PCM where there is any. Its SHA-256
    over a stream equals ``sha256_tensors`` of the frames' tensors in order (the digest hashes raw bytes)."""
    parts = [tokens.reshape(-1).view(torch.uint8)]
    if pcm is not None:
        parts.append(pcm.reshape(-1).view(torch.uint8))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _build(args, device: str):
    """The upstream stack at the configuration, seeded: (the adapter module, up, cfg, steps, build s)."""
    from cadence_fx.adapters import moshi as mo

    up = mo.load_moshi()
    cfg = mo.MoshiConfig.reduced() if args.reduced else mo.MoshiConfig()
    t0 = time.perf_counter()
    steps = mo.build_steps(up, cfg, device)
    if device == "cuda":
        torch.cuda.synchronize()
    return mo, up, cfg, steps, time.perf_counter() - t0


class _Frames:
    """What every Moshi conversation step shares: the per-frame inputs (the script's audio) and the
    calling convention ``(x, state) -> (frame bytes, state')`` (``next_args``, ``carry``)."""

    inputs = ("x", "state")

    def __init__(self, frame_size: int, device: str) -> None:
        self.frame_size, self.device = frame_size, device

    def fresh(self, n: int, _spk: Any = None, *, seed: int = 0) -> list[dict]:
        from cadence_fx.adapters.moshi import user_audio

        return [{"x": x} for x in user_audio(n, frame_size=self.frame_size, seed=seed, device=self.device)]

    def next_args(self, fresh: dict, state: dict) -> tuple:
        return fresh["x"], state

    @staticmethod
    def carry(out: tuple) -> dict:
        return out[1]


# --------------------------------------------------------------------------- the stock code
class StockFrame(_Frames):
    """A stock process's conversation, one frame per :meth:`driver_call`: the upstream modules keep the
    state; the carried state is the frame index only (``{"frame": 0-dim tensor}``), and frame 0
    starts the conversation: ``vendor``, as the server starts a connection (``reset_streaming`` of Mimi
    and ``LMGen``, graphs kept); ``eager``, from the freshly built state installed again."""

    def __init__(self, mo: Any, up: Any, steps: Any, device: str, mode: str) -> None:
        super().__init__(steps.encode.module.frame_size, device)
        if mode not in SOLO_STOCK:
            raise ValueError(f"stock mode {mode!r}: one of {SOLO_STOCK}")
        self.mo, self.up, self.steps, self.mode = mo, up, steps, mode
        self.graphed = mode == "vendor" and device == "cuda"
        self.initial = steps.initial_state() if mode == "eager" else None
        if mode == "vendor":
            self.warmup()

    def _eager(self):
        return self.mo.upstream_eager(self.up, cuda_graph=self.graphed)

    def warmup(self) -> None:
        """``ServerState.warmup``: frames of silence through encode, ``LMGen.step`` and decode (moshi's
        ``CUDAGraphed`` capture on the second call of each graphed function)."""
        from cadence_fx.adapters.moshi.driver import stock_frame

        with self._eager(), torch.no_grad():
            for k in range(WARMUP_FRAMES):
                stock_frame(self.steps, torch.zeros(1, 1, self.frame_size, device=self.device), k)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def start(self) -> None:
        """A new conversation on these modules."""
        if self.mode == "vendor":
            self.steps.decode.module.reset_streaming()  # Mimi: encoder and decoder side
            self.steps.lm.gen.reset_streaming()
        else:
            for s in STAGES:
                self.mo.install_state(getattr(self.steps, s), self.initial[s])

    def driver_call(self, x: torch.Tensor, state: dict) -> tuple:
        k = int(state["frame"])
        if k == 0:
            self.start()
        from cadence_fx.adapters.moshi.driver import stock_frame

        with self._eager(), torch.no_grad():
            f = stock_frame(self.steps, x, k)
            return frame_bytes(f.tokens, f.pcm), {"frame": torch.tensor(k + 1)}


def stock_bench(args, device: str) -> MoshiBench:
    """``build_bench`` for ``--model moshi`` (the stock and solo processes): the vendor's process, or for
    a solo run with ``--solo-stock eager`` the eager stock code."""
    mo, up, _cfg, steps, build_s = _build(args, device)
    mode = (getattr(args, "solo_stock", None) or "vendor") if getattr(args, "solo", None) is not None else "vendor"
    step = StockFrame(mo, up, steps, device, mode)
    return MoshiBench(step=step, spk=None, state0={"frame": torch.tensor(0)}, steps=steps, build_s=build_s)


# --------------------------------------------------------------------------- the optimized programs
class Conversation:
    """One conversation through the three programs: a session of each (its own state buffers; the LM's
    random streams seeded with the script's seed). Called like :class:`StockFrame.driver_call`; the
    carried state is the frame index and each step's state as its session returned it."""

    def __init__(self, owner: "Conversations", sessions: dict) -> None:
        self.owner, self.sessions = owner, sessions

    def __call__(self, x: torch.Tensor, state: dict) -> tuple:
        from cadence_fx.adapters.moshi import step_frame

        k = int(state["frame"])
        st = {s: dict(state[s]) for s in STAGES}
        if k == 0:  # the shared initial state: a plain (non-region) input is this conversation's own
            st = {s: {n: t if n in self.owner.regions[s] else t.clone() for n, t in st[s].items()} for s in STAGES}
        f = step_frame(self.owner.steps, self.sessions, st, x, k)
        return frame_bytes(f.tokens, f.pcm), {"frame": k + 1, **st}

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.sessions.values())

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()


class _Lanes:
    def __init__(self, lanes: list) -> None:
        self.lanes = lanes


class Conversations:
    """The three optimized programs as ``cadence_worker.serve`` sees one program: ``session(name, seed)``
    is a :class:`Conversation`; ``lanes`` are the LM program's (how many serving threads a worker
    starts by default: one per lane; every program has as many); ``counters`` per program;
    ``memory_census`` summed over the programs by kind."""

    def __init__(self, steps: Any, progs: dict, contracts: dict) -> None:
        self.steps, self.progs = steps, progs
        self.regions = {s: {r.input for r in contracts[s].regions} for s in STAGES}
        self.lanes = _Lanes(progs["lm"].lanes.lanes)

    def session(self, name: str, *, seed: int | None = None, pin: bool = False) -> Conversation:
        """One conversation: a session of each program (``pin``: each pinned to a lane of its own;
        :class:`cadence_fx.NoLaneToPin`, with nothing left pinned, when a program has none left)."""
        opened: dict = {}
        try:
            for s in STAGES:
                opened[s] = self.progs[s].session(f"{name}-{s}", seed=seed, pin=pin)
        except BaseException:
            for sess in opened.values():
                sess.close()
            raise
        return Conversation(self, opened)

    def counters(self) -> dict:
        return {s: p.counters() for s, p in self.progs.items()}

    def memory_census(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.progs.values():
            for k, v in p.memory_census().items():
                out[k] = out.get(k, 0) + v
        return out


@contextlib.contextmanager
def _build_turn(args, wait_s: float = 300.0):
    """``--share-weights``: the workers of a GPU build their LM one at a time, slot 0 first, the others
    once its weights are published, and none goes on to export, capture or serve before every one has
    built and mapped, so a GPU holds one copy plus one build at a time. (A fourth worker's first
    allocation still fails on an H100 with this order and the GPU 71 % free: docs/benchmarks.md, session 33.)"""
    import fcntl

    from cadence_fx.runtime.process_weights import read_publication

    if args.slot != 0:
        read_publication(_publication_path(args), wait_s=wait_s)
    with open(os.path.join(args.share_weights_dir, f"build-gpu{args.worker}.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    done = os.path.join(args.share_weights_dir, f"built-gpu{args.worker}-slot{args.slot}")
    open(done, "w").close()
    _wait_for_builds(args, wait_s)


def _wait_for_builds(args, wait_s: float) -> None:
    """Until every slot of this GPU (``--share-weights-slots``) has built; ``SystemExit`` past ``wait_s``."""
    deadline = time.monotonic() + wait_s
    want = [os.path.join(args.share_weights_dir, f"built-gpu{args.worker}-slot{j}")
            for j in range(args.share_weights_slots)]
    while not all(os.path.exists(f) for f in want):
        if time.monotonic() >= deadline:
            missing = [j for j, f in enumerate(want) if not os.path.exists(f)]
            raise SystemExit(f"--share-weights: slot(s) {missing} of gpu {args.worker} did not build in {wait_s:g} s")
        time.sleep(0.1)


def _publication_path(args) -> str:
    return os.path.join(args.share_weights_dir, f"lm-gpu{args.worker}.json")


def _share_lm_weights(gen: Any, args) -> dict:
    """``--share-weights``: slot 0 publishes the LM's parameters, every other slot of the GPU maps them
    (after its own build, which they must equal bit for bit) before anything is exported, so the
    programs and their graphs read the one copy. Returns what the ready line reports."""
    from cadence_fx.runtime.process_weights import map_weights, publish_weights

    path = _publication_path(args)
    t0 = time.perf_counter()
    if args.slot == 0:
        mib = publish_weights(gen.lm_model, path) / 2**20
        out = dict(role="published", mib=mib)
    else:
        mib = map_weights(gen.lm_model, path) / 2**20
        out = dict(role="mapped", freed_mib=mib)
    out["seconds"] = time.perf_counter() - t0
    print(f"[moshi] LM weights {out['role']}: {mib:.0f} MiB in {out['seconds']:.1f} s", file=sys.stderr, flush=True)
    return out


def optimized_bench(args, device: str) -> tuple[MoshiBench, Conversations, dict]:
    """Build, export and optimize the three steps with ``args.lanes`` lanes, free the upstream copy of
    the state and capture every lane: the SRc worker's model. Returns (bench, programs, facts)."""
    import cadence_fx as cf
    from cadence_fx.adapters.streaming import export_step_catalog

    shared = None
    if getattr(args, "share_weights_dir", None):
        with _build_turn(args):
            mo, _up, _cfg, steps, build_s = _build(args, device)
            shared = _share_lm_weights(steps.lm.gen, args)
    else:
        mo, _up, _cfg, steps, build_s = _build(args, device)
    examples = steps.examples()
    contracts = {s: mo.moshi_contract(getattr(steps, s)) for s in STAGES}
    facts: dict[str, Any] = dict(build_s=build_s, export_s={}, optimize_s={}, warmup_s={})
    if shared is not None:
        facts["share_weights"] = shared
    progs = {}
    for s in STAGES:
        step = getattr(steps, s)
        t0 = time.perf_counter()
        eps = export_step_catalog(step, step.initial_state(), [{"x": examples[s]}], contracts[s])
        facts["export_s"][s] = time.perf_counter() - t0
        replay: Any = "auto"
        if device == "cuda":  # one backend per program: each lane forks it (its own stream, pool, generator)
            from cadence_fx.runtime.backends import CudaGraphBackend

            replay = CudaGraphBackend(branches=args.branches, blas_streams=args.blas_streams)
        t0 = time.perf_counter()
        progs[s] = cf.optimize(eps, contracts[s], lanes=args.lanes, replay=replay,
                               journal=getattr(args, "journal", False))
        facts["optimize_s"][s] = time.perf_counter() - t0
        del eps
        print(f"[moshi] {s}: export {facts['export_s'][s]:.1f} s, optimize {facts['optimize_s'][s]:.1f} s "
              f"({args.lanes} lanes)", file=sys.stderr, flush=True)
    # every conversation's first call copies this state into its sessions' buffers (one copy on the device)
    state0: dict[str, Any] = {"frame": 0, **{s: getattr(steps, s).initial_state(device) for s in STAGES}}
    facts["released_stock_state_mib"] = sum(getattr(steps, s).release_state() for s in STAGES) / 2**20
    for s in STAGES:
        facts["warmup_s"][s] = progs[s].warmup(examples[s])["seconds"]
    conv = Conversations(steps, progs, contracts)
    step = _Frames(steps.encode.module.frame_size, device)
    return MoshiBench(step=step, spk=None, state0=state0, steps=steps, build_s=build_s), conv, facts


def run_worker(args) -> None:
    """``benchmarks/cadence.py --worker G --model moshi``: the SRc process of one GPU (the protocol of
    ``benchmarks.cadence_worker.run_worker``: a ready line, then one reply per ``serve`` command)."""
    from benchmarks.cadence_measure import BusyWindow
    from benchmarks.cadence_worker import serve

    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    device = child_setup()
    t0 = time.perf_counter()
    bench, conv, facts = optimized_bench(args, device)
    total = time.perf_counter() - t0
    if device == "cuda" and args.busy_window > 0:
        os.environ.setdefault("TEARDOWN_CUPTI", "0")  # as the Token2Wav worker: CUPTI beside CUDA graphs
        BusyWindow.warm()
    census = {s: {k: v / 2**20 for k, v in p.memory_census().items()} for s, p in conv.progs.items()}
    ready = dict(ready=True, gpu=args.worker, device=device_name(device), build_s=facts["build_s"],
                 export_s=sum(facts["export_s"].values()), optimize_s=sum(facts["optimize_s"].values()),
                 warmup_s=sum(facts["warmup_s"].values()), setup_s=total, lanes=len(conv.lanes.lanes),
                 per_stage=facts, base_census_mib={k: v / 2**20 for k, v in conv.memory_census().items()},
                 census_per_program_mib=census)
    proto.write(json.dumps(ready) + "\n")
    proto.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        proto.write(json.dumps(serve(conv, bench, cmd, args, device)) + "\n")
        proto.flush()
