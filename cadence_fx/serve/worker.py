"""A worker: one optimized program loaded from an artifact, serving many conversations (a Ray actor).

One worker per GPU (per process on the CPU). It loads the program once from a saved artifact
(``cf.load(path, sha256=...)``: pinned, no export, no passes; lanes rebuilt by ``load(lanes=...)``),
captures every class before traffic (``warmup``), then takes its capacity from the config or measures
it (:mod:`cadence_fx.serve.calibration`), so a worker that says it is ready is ready: no conversation
pays a capture or a first-call set-up.

Each conversation is a session of that program; its state never leaves the worker except as a
:class:`~cadence_fx.serve.conversation.ConversationState` (export, snapshot). The client sends a
chunk's own inputs with a sequence number and gets the chunk's own outputs on the host; the worker
feeds the session's returned state to the next call itself. A chunk is applied exactly once, in
order: another number is refused (:class:`~cadence_fx.serve.conversation.SequenceError`), and a call
that raises leaves the conversation as before it (sessions are transactions), so a retry is exact.
Chunks may come straight from a router in the client's process (:mod:`cadence_fx.serve.router`) with
the epoch of the placement it cached: a conversation frozen for a move, moved away, or here under
another epoch refuses them with :class:`~cadence_fx.serve.conversation.Fenced` (nothing applied).
What moves a conversation's bytes in or out whole (exports, imports, handoffs on one GPU) is the
:class:`~cadence_fx.serve.transfer.Transfers` mixin, apart from the conversations' life kept here.

:class:`ConversationWorker` is a plain class (usable in-process, as the benchmark's baseline does);
:func:`worker_actor` starts it as a threaded Ray actor, with one thread per lane plus a few for
status and moves, since a Ray actor runs one call at a time unless told otherwise.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import ray
import torch

from cadence_fx.artifact import load
from cadence_fx.determinism import sha256_tensors
from cadence_fx.runtime.sessions import Session, Snapshot
from cadence_fx.runtime.warmup import LaneWarmup
from cadence_fx.serve.calibration import Calibration, percentile
from cadence_fx.serve.conversation import (AdmissionRefused, ConversationClosed, ConversationExists,
                                           ConversationState, Fenced, StepResult, UnknownConversation,
                                           sequence_error)
from cadence_fx.serve import packing, wire
from cadence_fx.serve.handoff import device_identity
from cadence_fx.serve.readiness import Readiness
from cadence_fx.serve.transfer import Transfers
from cadence_fx.serve.layout import StepLayout
from cadence_fx.serve.sharing import artifact_file, share_artifact

__all__ = ["ConversationWorker", "WorkerConfig", "WorkerStatus", "share_artifact", "worker_actor"]

log = logging.getLogger("cadence_fx.serve")

Prompt = Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | None


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker is built. ``artifact``/``sha256``: the file ``cf.save`` wrote (a path every node can
    read, or the file's bytes in the object store: :func:`share_artifact`) and the digest it returned
    (pinned: another file is refused; ``None`` skips the pin). ``capacity``: a measured N
    (the cadence benchmark's) or ``None`` to calibrate at start against ``deadline_s`` (the chunk
    period) up to ``calibrate_max`` conversations. ``example``/``prompt``: one chunk's inputs and an
    initial state for warm-up and calibration (default: zeros of the first class's shapes).
    ``threads``: torch's intra-op threads (CPU workers; ``None`` leaves Ray's setting).
    ``serve_from_lanes``: the worker is ready once this many lanes are captured; the others capture on a
    background thread beside traffic and join one by one, and the capacity admitted grows with them
    (``capacity x online // lanes``). It needs ``capacity`` given: a worker still capturing cannot
    measure its own. ``None``: every lane is captured before the worker is ready. ``full_lanes``: only
    that many lanes capture every catalog class, the others its steady (last) class alone, and calls of
    the other classes (a conversation's first chunks) go to the full lanes (``OptimizedProgram.warmup``):
    a shorter start, the same bytes. ``None``: every lane captures every class."""

    artifact: Any  # a path, or an object ref of the file's bytes (share_artifact)
    sha256: str | None = None
    lanes: int = 1
    replay: str = "auto"
    device: str | None = None
    capacity: int | None = None
    deadline_s: float = 1.0
    calibrate_max: int = 8
    calibrate_rounds: int = 4
    threads: int | None = None
    example: tuple[Any, ...] | None = None
    prompt: tuple[torch.Tensor, ...] | None = None
    check_weights: bool = True
    memory_margin: float = 0.8  # of the device's free memory, what calibration lets sessions take
    serve_from_lanes: int | None = None  # serve once this many lanes are captured; the rest capture beside traffic
    full_lanes: int | None = None  # lanes that capture every class; the rest capture the steady class only


@dataclass(frozen=True)
class WorkerStatus:
    """A worker as admission and the metrics see it. ``load``: conversations / capacity.
    ``lanes_busy``: calls running now. ``ready_s``: construction to ready (load + warm-up +
    calibration); ``load_s``, ``warmup_s``, ``calibrate_s`` its parts."""

    name: str
    pid: int
    node_id: str | None
    device: str
    lanes: int
    capacity: int
    calibration: Calibration
    conversations: tuple[str, ...]
    load: float
    lanes_busy: int
    ready_s: float
    load_s: float
    warmup_s: float
    calibrate_s: float
    chunks: int
    chunk_p50_ms: float
    chunk_p99_ms: float
    identity: str | None = None  # node/GPU-UUID: workers naming the same one hand conversations off on the device
    load_split: Mapping[str, float] = field(default_factory=dict)  # where cf.load spent load_s (its load_report)
    lanes_online: int = 0  # lanes captured and serving now (``serve_from_lanes``: the rest still capturing)
    capacity_full: int = 0  # the capacity once every lane is online (``capacity`` is what is admitted now)
    lanes_ready_s: float | None = None  # construction to every lane captured (None while lanes capture)
    warmup_error: str | None = None  # a capture beside traffic that failed: its lanes stay offline


@dataclass
class _Conversation:
    session: Session
    state: dict[str, torch.Tensor]
    next_seq: int
    seed: int | None
    lock: threading.Lock
    epoch: int = 0  # the placement's fence token (the controller's)
    frozen: bool = False  # exported for a move: no chunk until the move is done (or undone: thaw)
    routed: bool = False  # its last chunk came from a router (with an epoch), not through the controller


class ConversationWorker(Readiness, Transfers):
    """Many conversations on one program loaded from an artifact (see the module docstring)."""

    def __init__(self, config: WorkerConfig, name: str = "worker") -> None:
        t0 = time.perf_counter()
        if config.serve_from_lanes is not None:
            if not 1 <= config.serve_from_lanes:
                raise ValueError(f"serve_from_lanes must be >= 1, got {config.serve_from_lanes}")
            if config.serve_from_lanes < config.lanes and config.capacity is None:
                raise ValueError("serve_from_lanes below lanes needs capacity given (the cadence benchmark's N): "
                                 "a worker whose lanes are still capturing cannot measure its own")
        wire.install()  # host tensors cross processes as numpy arrays (torch's pickle costs ~0.25 ms each)
        self.config, self.name = config, name
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        with artifact_file(config.artifact) as path:
            self.prog = load(path, sha256=config.sha256, lanes=config.lanes, replay=config.replay,
                             device=config.device, check_weights=config.check_weights)
        t_load = time.perf_counter()
        self.layout = StepLayout.of(self.prog)
        self.regions = [r.name for r in self.prog.contract.regions]
        self.device = next(iter(self.prog.region_buffers.values())).device
        zero_chunk, self._zero_state = self.layout.zeros(self.prog, self.device)
        self._example = [self._to_device(x) for x in config.example] if config.example is not None else zero_chunk
        warm_args = self.layout.call_args(self._example, self._zero_state)
        first = config.serve_from_lanes
        if first is not None and first < len(self.prog.lanes.lanes):
            self._warming: LaneWarmup | None = self.prog.warmup_in_background(*warm_args, first=first)
        else:
            self._warming = None
            self.prog.warmup(*warm_args, full_lanes=config.full_lanes)
        if self.device.type == "cuda":  # the staging of a conversation's export, pinned once (after the captures)
            packing.reserve_pinned(sum(rp.session_bytes for rp in self.prog.plan.regions)
                                   + packing.ALIGN * len(self.prog.plan.regions))
        t_warm = time.perf_counter()
        self._convs: dict[str, _Conversation] = {}
        self._handoffs: dict[str, torch.Tensor] = {}  # packed buffers shared with a move's target
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.identity = device_identity(self.device, node)  # who can map this worker's handoffs
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._moved: collections.OrderedDict[str, None] = collections.OrderedDict()  # moved away: Fenced
        self._lock = threading.Lock()
        self._busy = 0
        self._chunk_ms: collections.deque[float] = collections.deque(maxlen=2048)
        self._chunks = 0
        self.calibration = self._calibrate()
        t_ready = time.perf_counter()
        self._t0 = t0
        self._times = {"ready_s": t_ready - t0, "load_s": t_load - t0, "warmup_s": t_warm - t_load,
                       "calibrate_s": t_ready - t_warm}
        log.info("worker %s ready in %.2f s on %s: %s", name, t_ready - t0, self.device, self.calibration.describe())

    # ------------------------------------------------------------------ conversations
    def open(self, conv_id: str, seed: int | None = None, prompt: Prompt = None, *, replace: bool = False,
             force: bool = False, epoch: int = 0) -> int:
        """Open ``conv_id`` from ``prompt`` (its initial state: by region name, in contract order, or
        ``None`` for zeros) with random streams seeded by ``seed`` (drawn here when ``None``: a served
        conversation must be reproducible, so it always has one). Returns the seed. ``force`` admits past
        the capacity (a failover that has nowhere else to go). ``epoch``: the placement's fence token."""
        seed = int.from_bytes(os.urandom(7), "little") if seed is None else int(seed)
        state = self.layout.prompt(prompt, self.regions, self._zero_state)
        self._admit(conv_id, replace=replace, force=force)
        session = self.prog.session(conv_id, seed=seed)
        returned = session.restore(Snapshot({n: self._to_device(t) for n, t in state.items()}, None))
        self._adopt(conv_id, session, returned, 0, seed, epoch)
        return seed

    def step(self, conv_id: str, seq: int, inputs: Sequence[Any] | Mapping[str, Any],
             epoch: int | None = None) -> StepResult:
        """Apply chunk ``seq`` of ``conv_id``: the chunk's outputs on the host (the state stays here).
        ``epoch``: the placement a router sent it under (``None``: the controller's own call)."""
        t0 = time.perf_counter()
        conv = self._get(conv_id)
        with conv.lock:
            if conv.frozen or (epoch is not None and epoch != conv.epoch):
                raise Fenced(f"worker {self.name}: conversation {conv_id!r} is " + (
                    "frozen for a move" if conv.frozen else f"here under epoch {conv.epoch}, not {epoch}"))
            if seq != conv.next_seq:
                raise sequence_error(conv_id, seq, conv.next_seq)
            chunk = [self._to_device(x) for x in self.layout.chunk_inputs(inputs)]
            t_call = time.perf_counter()
            with self._running():
                out = conv.session(*self.layout.call_args(chunk, conv.state))
            visible, conv.state = self.layout.split_outputs(out)
            outputs = tuple(_to_host(o) for o in visible)  # waits for the device: the outputs are on the host
            call_s = time.perf_counter() - t_call
            conv.next_seq = seq + 1
            conv.routed = epoch is not None
        digest = sha256_tensors(o for o in outputs if isinstance(o, torch.Tensor))
        took = time.perf_counter() - t0
        with self._lock:
            self._chunk_ms.append(took * 1e3)
            self._chunks += 1
        return StepResult(conv_id, seq, outputs, digest, self.name, took, call_s)

    def replay(self, conv_id: str, chunks: Sequence[tuple[int, Any]]) -> list[str]:
        """Re-run journal chunks ``(seq, inputs)`` in order after a resume (one call, not one per chunk);
        the outputs' digests, for the controller to check against what the client was sent."""
        return [self.step(conv_id, seq, inputs).digest for seq, inputs in chunks]

    def restore(self, conv_id: str, state: ConversationState) -> None:
        """Put ``conv_id`` back to ``state`` (a barge-in: back to a turn boundary): its regions, random
        streams and stream position (the next chunk is the snapshot's ``next_seq``, as the front end's
        protocol has it: the chunks after the snapshot are taken again)."""
        conv = self._get(conv_id)
        with conv.lock:
            conv.state = self._restore_into(conv.session, state)
            conv.next_seq = state.next_seq

    def thaw(self, conv_id: str) -> None:
        """Take chunks again after a move that did not happen (its target failed)."""
        self._get(conv_id).frozen = False
        self._release_handoff(conv_id)

    def close(self, conv_id: str, *, moved: bool = False) -> None:
        """Close ``conv_id`` and free its buffers; later calls for it raise ``ConversationClosed``, or
        with ``moved`` (it lives on another worker now) :class:`Fenced`."""
        with self._lock:
            conv = self._convs.pop(conv_id, None)
            if conv is None:
                raise self._missing(conv_id)
            _remember(self._moved if moved else self._closed, conv_id)
        with conv.lock:
            conv.session.close()
        self._release_handoff(conv_id)

    # ------------------------------------------------------------------ the worker
    def status(self) -> WorkerStatus:
        with self._lock:
            convs = tuple(self._convs)
            recent = list(self._chunk_ms)
            busy, chunks = self._busy, self._chunks
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        load = len(convs) / self.capacity if self.capacity else float("inf") if convs else 0.0
        return WorkerStatus(self.name, os.getpid(), node, str(self.device), len(self.prog.lanes.lanes),
                            self.capacity, self.calibration, convs, load, busy, self._times["ready_s"],
                            self._times["load_s"], self._times["warmup_s"], self._times["calibrate_s"], chunks,
                            percentile(recent, 50), percentile(recent, 99), identity=self.identity,
                            load_split={k: float(v) for k, v in getattr(self.prog, "load_report", {}).items()},
                            lanes_online=self.prog.lanes.online(), capacity_full=self.calibration.capacity,
                            lanes_ready_s=self._lanes_ready_s(), warmup_error=self._warmup_error())

    def example(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """What a chunk carries (by input name, in order) and an initial state (by region), on the host:
        the config's example and prompt, or zeros of the first class's shapes (what a front end reads
        its chunk spec off, and what the benchmark sends to an artifact it knows nothing of)."""
        prompt = self.layout.prompt(self.config.prompt, self.regions, self._zero_state)
        chunk = {n: _to_host(x) for n, x in zip(self.layout.chunk_names, self._example)}
        return chunk, {n: _to_host(t) for n, t in prompt.items()}

    def ping(self) -> str:
        return self.name

    def pid(self) -> int:
        return os.getpid()

    def conversation_table(self) -> dict[str, dict[str, Any]]:
        """Each open conversation's placement facts, by id: ``epoch``, ``next_seq``, ``seed``, ``frozen``
        (exported for a move) and ``routed`` (its last chunk came from a router): what a restarted
        controller rebuilds its table from (``ControllerConfig.restartable``)."""
        with self._lock:
            convs = dict(self._convs)
        return {cid: {"epoch": c.epoch, "next_seq": c.next_seq, "seed": c.seed, "frozen": c.frozen, "routed": c.routed}
                for cid, c in convs.items()}

    def conversations(self) -> list[str]:
        with self._lock:
            return list(self._convs)

    # ------------------------------------------------------------------ inside
    def _admit(self, conv_id: str, *, replace: bool, force: bool) -> None:
        with self._lock:
            if conv_id in self._convs:
                if not replace:
                    raise ConversationExists(f"worker {self.name}: conversation {conv_id!r} is already open here")
                self._convs.pop(conv_id).session.close()
            elif not force and len(self._convs) >= self.capacity:
                raise AdmissionRefused(f"worker {self.name} is at capacity: {len(self._convs)} of "
                                       f"{self.capacity} conversations ({self.calibration.describe()})")

    def _adopt(self, conv_id: str, session: Session, state: dict[str, torch.Tensor], next_seq: int,
               seed: int | None, epoch: int) -> None:
        """Hold ``session`` here as ``conv_id``, ``state`` its returned state, ``next_seq`` its next chunk."""
        self._install(conv_id, _Conversation(session, state, next_seq, seed, threading.Lock(), epoch))

    def _install(self, conv_id: str, conv: _Conversation) -> None:
        with self._lock:
            self._convs[conv_id] = conv
            self._closed.pop(conv_id, None)
            self._moved.pop(conv_id, None)

    def _get(self, conv_id: str) -> _Conversation:
        with self._lock:
            conv = self._convs.get(conv_id)
            if conv is None:
                raise self._missing(conv_id)
            return conv

    def _missing(self, conv_id: str) -> Exception:
        if conv_id in self._moved:
            return Fenced(f"worker {self.name}: conversation {conv_id!r} was moved to another worker")
        if conv_id in self._closed:
            return ConversationClosed(f"worker {self.name}: conversation {conv_id!r} was closed")
        return UnknownConversation(f"worker {self.name}: no conversation {conv_id!r} here (open: "
                                   f"{len(self._convs)})")

    @contextmanager
    def _running(self) -> Iterator[None]:
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _to_device(self, x: Any) -> Any:
        return x.to(self.device) if isinstance(x, torch.Tensor) and x.device != self.device else x


def _remember(ids: collections.OrderedDict[str, None], conv_id: str) -> None:
    ids[conv_id] = None
    while len(ids) > 4096:
        ids.popitem(last=False)


def _to_host(x: Any) -> Any:
    """An output as the client gets it: a host tensor of its own (never a view of the worker's buffers)."""
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().cpu() if x.device.type != "cpu" else x.detach().clone()


def worker_actor(config: WorkerConfig, *, name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Start a :class:`ConversationWorker` as a Ray actor; ``options`` go to ``.options()`` (resources:
    ``num_gpus=1`` per GPU worker, ``num_cpus`` on the CPU). Threaded: one call per lane at once, plus
    a few threads so status and moves are not queued behind chunks. Never restarted by Ray: a worker
    that died lost its sessions, and the controller resumes them from checkpoints elsewhere."""
    opts: dict[str, Any] = {"max_concurrency": config.lanes + 4, "max_restarts": 0}
    opts.update(options or {})
    return ray.remote(ConversationWorker).options(**opts).remote(config, name)
