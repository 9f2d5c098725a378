"""The controller: one Ray actor that places conversations on workers, routes their chunks, and fails over.

A chunk reaches a worker one of two ways. Through the controller (:meth:`ServeController.step`):
the controller holds the conversation's next sequence number, the affinity table (the worker holding
its state: every chunk goes there), and the journal a failover re-runs; two actor hops. Or straight
from a router in the caller's process (:mod:`cadence_fx.serve.router`, one hop), which asks the
controller only for the conversation's placement (:class:`~cadence_fx.serve.routes.Routes`) and keeps
the journal itself; a conversation is opened for one way or the other (``routed``). A worker that dies
mid-stream (``ray.kill``, a ``SIGKILL``, a lost machine: Ray reports each as ``RayActorError`` to the
next call, and a periodic ping finds idle ones) is fenced (killed, never used again); each of its
conversations is resumed on a worker with room from its last checkpoint plus the chunks since
(:mod:`cadence_fx.serve.checkpoints`), and the chunk in flight is sent again to the new worker. The
client sees one answer per chunk, bit-identical to an uninterrupted run.

It is an async actor: chunks of different conversations run concurrently (each worker runs as many
at once as it has lanes), while the calls on one conversation are serialized by its own lock, held
from the sequence check to the journal entry. Migration, drain and rebalance
(:class:`~cadence_fx.serve.migration.Moves`) and turn boundaries (:class:`~cadence_fx.serve.turns.Turns`:
snapshots, restores, checkpoints) hold the same lock, so they happen between two chunks. Failover is
:class:`~cadence_fx.serve.checkpoints.Failover`'s, the placement rules :mod:`cadence_fx.serve.placement`'s,
what is measured :mod:`cadence_fx.serve.metrics`'s, what a router asks :class:`~cadence_fx.serve.routes.Routes`'.

The controller is a single actor, not replicated. By default Ray fate-shares the workers it starts
with it, so a lost controller takes every worker and session along. With ``ControllerConfig.restartable``
the workers are detached and named after it, Ray restarts it, and the restarted instance adopts them
and their conversations (:mod:`cadence_fx.serve.adoption`): routers stream on meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from cadence_fx.serve import wire
from cadence_fx.serve.adoption import Adoption, worker_actor_name
from cadence_fx.serve.checkpoints import CheckpointPolicy, Failover, Journal, put_checkpoint
from cadence_fx.serve.conversation import (AdmissionRefused, ConversationClosed, ConversationExists,
                                           NoWorkers, StepResult, UnknownConversation,
                                           sequence_error)
from cadence_fx.serve.metrics import ServeMetrics
from cadence_fx.serve.migration import MoveReport, Moves
from cadence_fx.serve.placement import WorkerView, choose
from cadence_fx.serve.routes import Routes
from cadence_fx.serve.tables import ConvRow, WorkerRow
from cadence_fx.serve.turns import Turns
from cadence_fx.serve.warming import Warming, lanes_online
from cadence_fx.serve.worker import WorkerConfig, WorkerStatus, worker_actor

__all__ = ["CONTROLLER_NAME", "ControllerConfig", "ServeController", "get_controller", "start_controller"]

log = logging.getLogger("cadence_fx.serve")

CONTROLLER_NAME = "cadence_fx_serve_controller"


@dataclass(frozen=True)
class ControllerConfig:
    """``checkpoint``: when conversations are checkpointed. ``reorder_s``: how long a chunk that
    arrives ahead of its predecessor waits for it before it is refused (a pipelining client's chunks
    may arrive out of order). ``health_interval_s``: how often idle workers are pinged (0: never;
    a dead worker is still found by the next chunk sent to it); ``health_timeout_s``: a ping that
    takes longer counts as a dead worker."""

    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    reorder_s: float = 0.2
    health_interval_s: float = 1.0
    health_timeout_s: float = 10.0
    metrics_window: int = 1024
    handoff: bool = True  # moves between two workers on one GPU stay on it (CUDA IPC: serve.handoff)
    # workers outlive the controller (detached, named after it); Ray restarts the controller, which
    # adopts them and their conversations (serve.adoption)
    restartable: bool = False


class ServeController(Adoption, Moves, Failover, Turns, Routes, Warming):
    """Placement, routing, checkpoints and failover for conversations on :class:`ConversationWorker` s."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        wire.install()  # chunks and their outputs cross as numpy arrays
        self.config = config or ControllerConfig()
        self._workers: dict[str, WorkerRow] = {}
        self._convs: dict[str, ConvRow] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._room = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._health: asyncio.Task[Any] | None = None
        self._added = 0
        self._resumes: collections.deque[dict[str, Any]] = collections.deque(maxlen=4096)
        self.metrics = ServeMetrics(self.config.metrics_window)
        self.adopted: dict[str, Any] = {}
        self._name = (ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None) or CONTROLLER_NAME
        if self.config.restartable:  # a restart (or a first start: nothing named after it yet)
            self._adopt(self._name)

    def _ensure_watch(self) -> None:
        """The health watch and the lanes' (:mod:`~cadence_fx.serve.warming`), also for workers adopted
        in the constructor (no loop ran there)."""
        self._watch_lanes()
        if self._health is None and self._workers and self.config.health_interval_s > 0:
            self._health = self._spawn(self._watch())

    # ------------------------------------------------------------------ workers
    async def add_worker(self, config: WorkerConfig, name: str | None = None,
                         options: Mapping[str, Any] | None = None) -> WorkerStatus:
        """Start a worker from ``config`` (an artifact) and admit conversations onto it once it is ready
        (loaded, warmed up, calibrated; with ``serve_from_lanes``, its first lanes: its capacity grows as
        the others come online, :mod:`~cadence_fx.serve.warming`). Conversations left without a worker
        are resumed on it."""
        self._added += 1
        name = name or f"worker-{self._added}"
        if name in self._workers and self._workers[name].alive:
            raise ValueError(f"a live worker is already named {name!r}")
        t0 = time.perf_counter()
        if self.config.restartable:  # outlives this instance, found again by name by the next one
            options = {**(options or {}), "lifetime": "detached", "name": worker_actor_name(self._name, name)}
        handle = worker_actor(config, name=name, options=options)
        status: WorkerStatus = await handle.status.remote()
        self._workers[name] = WorkerRow(name, handle, status.capacity, status.lanes, config.deadline_s,
                                        time.perf_counter() - t0, status)
        log.info("worker %s joined: capacity %d, %d of %d lane(s) online, ready %.2f s after it was started",
                 name, status.capacity, lanes_online(status), status.lanes, time.perf_counter() - t0)
        for conv in list(self._convs.values()):
            if not self._alive(conv.worker):
                self._spawn(self._resume_task(conv))
        await self._notify_room()
        self._ensure_watch()
        return status

    async def remove_worker(self, name: str) -> list[MoveReport]:
        """Drain ``name`` (its conversations move to other workers) and stop it (a deploy)."""
        reports = await self.drain(name)
        w = self._workers.pop(name)
        w.alive = False
        ray.kill(w.handle, no_restart=True)
        return reports

    async def worker_handle(self, name: str) -> Any:
        """The Ray actor handle of worker ``name`` (to query it, or to kill it in a test)."""
        return self._worker(name).handle

    # ------------------------------------------------------------------ conversations
    async def open(self, conv_id: str, seed: int | None = None, prompt: Any = None, *, wait_s: float = 0.0,
                   worker: str | None = None, routed: bool = False) -> dict[str, Any]:
        """Open ``conv_id`` on the least loaded worker with room (or ``worker``), from ``prompt`` (its
        initial state) with random streams seeded by ``seed`` (drawn when ``None``, and returned: a
        conversation must be reproducible to be resumed). When every worker is at capacity it waits up
        to ``wait_s`` for room, then raises :class:`AdmissionRefused` saying why. ``routed``: its chunks
        will come from a :class:`~cadence_fx.serve.router.Router` (the reply has its ``placement``)."""
        self._ensure_watch()  # a restarted controller's first call may be this one
        if conv_id in self._convs:
            raise ConversationExists(f"conversation {conv_id!r} is already open (on {self._convs[conv_id].worker})")
        seed = int.from_bytes(os.urandom(7), "little") if seed is None else int(seed)
        prompt_ref = put_checkpoint(prompt) if prompt is not None else None
        deadline = time.monotonic() + wait_s
        async with self._room:
            while True:
                try:
                    target = self._pinned(worker) if worker is not None else choose(self._views())
                    break
                except AdmissionRefused as e:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.metrics.count("admission_refused")
                        raise AdmissionRefused(f"conversation {conv_id!r} refused: {e}"
                                               + (f" (waited {wait_s:g} s for room)" if wait_s else "")) from None
                    try:
                        await asyncio.wait_for(self._room.wait(), left)
                    except asyncio.TimeoutError:
                        pass
            conv = ConvRow(conv_id, target, seed, Journal.opened(seed, prompt_ref), asyncio.Condition(),
                           time.monotonic(), routed=routed)
            self._convs[conv_id] = conv  # reserved before the call: concurrent opens see it
        try:
            async with conv.cond:
                await self._on_worker(conv, lambda h: h.open.remote(conv_id, seed, prompt_ref, replace=True))
        except BaseException:
            self._convs.pop(conv_id, None)
            await self._notify_room()
            raise
        opened = {"conv_id": conv_id, "worker": conv.worker, "seed": seed, "next_seq": 0}
        return {**opened, "placement": self._placement(conv)} if routed else opened

    async def step(self, conv_id: str, seq: int, inputs: Sequence[Any] | Mapping[str, Any], *,
                   end_of_turn: bool = False) -> StepResult:
        """Chunk ``seq`` of ``conv_id`` on the worker holding its state: its outputs. ``end_of_turn``:
        the last chunk of a turn (a checkpoint follows, with the policy's ``at_turn_end``)."""
        t0 = time.perf_counter()
        conv = self._conv(conv_id)
        async with conv.cond:
            if seq > conv.next_seq and self.config.reorder_s > 0:  # its predecessor may still be on the way
                try:
                    await asyncio.wait_for(conv.cond.wait_for(lambda: conv.next_seq >= seq or conv.closed),
                                           self.config.reorder_s)
                except asyncio.TimeoutError:
                    pass
            if conv.closed:
                raise ConversationClosed(f"conversation {conv_id!r} was closed")
            if conv.routed:
                raise ValueError(f"conversation {conv_id!r} was opened for a router, which keeps its journal: "
                                 "send its chunks through that router")
            if seq != conv.next_seq:
                self.metrics.count("sequence_refused")
                raise sequence_error(conv_id, seq, conv.next_seq)
            t_call = time.perf_counter()
            res: StepResult = await self._on_worker(conv, lambda h: h.step.remote(conv_id, seq, inputs))
            overhead = time.perf_counter() - t_call - res.worker_s
            conv.next_seq = seq + 1
            conv.journal.record(seq, inputs, res.digest)
            due = conv.journal.due(self.config.checkpoint, end_of_turn)
            conv.cond.notify_all()
        w = self._workers[res.worker]
        self.metrics.chunk(conv_id, res.worker, time.perf_counter() - t0, overhead, w.deadline_s)
        if due:
            self._spawn(self._checkpoint_task(conv))
        return res

    async def close(self, conv_id: str) -> None:
        """Close ``conv_id`` on its worker and forget it; later calls raise :class:`ConversationClosed`."""
        conv = self._conv(conv_id)
        async with conv.cond:
            if conv.closed:
                raise ConversationClosed(f"conversation {conv_id!r} was closed")
            w = self._workers.get(conv.worker)
            if w is not None and w.alive:
                try:
                    await w.handle.close.remote(conv_id)
                except RayActorError as e:
                    self._worker_died(w.name, e)
                except UnknownConversation:
                    pass
            conv.closed = True
            self._convs.pop(conv_id, None)
            self._closed[conv_id] = None
            while len(self._closed) > 65536:
                self._closed.popitem(last=False)
            self.metrics.forget(conv_id)
            conv.cond.notify_all()
        await self._notify_room()

    # ------------------------------------------------------------------ reading
    async def ping(self) -> str:
        """Nothing: one actor call's floor (what the benchmark subtracts to split routing's cost)."""
        return "controller"

    async def example(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a chunk carries (by input name) and an initial state, from a live worker
        (:meth:`ConversationWorker.example`): a front end's chunk spec."""
        for w in self._workers.values():
            if w.alive:
                try:
                    example: tuple[dict[str, Any], dict[str, Any]] = await w.handle.example.remote()
                    return example
                except RayActorError as e:
                    self._worker_died(w.name, e)
        raise NoWorkers("no live worker to read the chunk's inputs off")

    async def affinity(self) -> dict[str, str]:
        """Conversation -> the worker holding its state."""
        return {c: conv.worker for c, conv in self._convs.items()}

    async def status(self) -> dict[str, Any]:
        """Workers (capacity, conversations, lanes, lanes busy, time to ready, their own status),
        conversations and the metrics summary."""
        self._ensure_watch()
        self._refresh_gauges()
        counts = self._counts()
        workers = {}
        for w in self._workers.values():
            workers[w.name] = {"alive": w.alive, "draining": w.draining, "capacity": w.capacity,
                               "conversations": counts.get(w.name, 0), "lanes": w.lanes,
                               "lanes_online": lanes_online(w.status),
                               "lanes_busy": min(w.in_flight, w.lanes), "spawn_to_ready_s": w.spawn_to_ready_s,
                               "ready_s": w.status.ready_s, "calibration": w.status.calibration.describe()}
        return {"workers": workers, "conversations": len(self._convs), "metrics": self.metrics.summary(),
                "resumes": list(self._resumes), "adopted": dict(self.adopted)}

    async def metrics_text(self) -> bytes:
        """The Prometheus text exposition of :attr:`metrics` (the front end serves it)."""
        self._refresh_gauges()
        return self.metrics.exposition()

    # ------------------------------------------------------------------ failover
    async def _on_worker(self, conv: ConvRow, make: Callable[[Any], Awaitable[Any]]) -> Any:
        """``make(handle)`` on the worker holding ``conv`` (whose lock the caller holds); a dead worker is
        failed over and the call sent again to the conversation's new worker."""
        for _attempt in range(len(self._workers) + 2):
            if not self._alive(conv.worker):
                await self._resume_locked(conv)
            w = self._workers[conv.worker]
            w.in_flight += 1
            try:
                return await make(w.handle)
            except RayActorError as e:
                self._worker_died(w.name, e)
            except RayTaskError as e:  # the worker's own error (a wrong input, a refusal): as itself
                raise e.as_instanceof_cause() from None
            finally:
                w.in_flight -= 1
        raise NoWorkers(f"conversation {conv.conv_id!r}: every worker it was sent to died")

    # ------------------------------------------------------------------ bookkeeping
    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    def _conv(self, conv_id: str) -> ConvRow:
        conv = self._convs.get(conv_id)
        if conv is not None:
            return conv
        if conv_id in self._closed:
            raise ConversationClosed(f"conversation {conv_id!r} was closed")
        raise UnknownConversation(f"no conversation {conv_id!r} (open: {len(self._convs)})")

    def _worker(self, name: str) -> WorkerRow:
        if name not in self._workers:
            raise LookupError(f"no worker {name!r} (workers: {sorted(self._workers)})")
        return self._workers[name]

    def _alive(self, name: str) -> bool:
        w = self._workers.get(name)
        return w is not None and w.alive

    def _counts(self) -> dict[str, int]:
        """Conversations per worker, a move's reservation on its target included."""
        counts = collections.Counter(c.worker for c in self._convs.values())
        counts.update(c.also_on for c in self._convs.values() if c.also_on not in (None, c.worker))
        return counts

    def _views(self) -> list[WorkerView]:
        counts = self._counts()
        return [WorkerView(w.name, counts.get(w.name, 0), w.capacity, w.alive, w.draining)
                for w in self._workers.values()]

    def _pinned(self, name: str) -> str:
        view = next((v for v in self._views() if v.name == name), None)
        if view is None:
            raise LookupError(f"no worker {name!r} (workers: {sorted(self._workers)})")
        if view.room <= 0:
            raise AdmissionRefused(f"worker {name} has no room: " + ("dead" if not view.alive else "draining"
                                   if view.draining else f"{view.conversations}/{view.capacity} conversations"))
        return name

    def _refresh_gauges(self) -> None:
        counts = self._counts()
        for w in self._workers.values():
            n = counts.get(w.name, 0)
            self.metrics.worker(w.name, conversations=n, capacity=w.capacity, lanes=w.lanes,
                                lanes_busy=min(w.in_flight, w.lanes), ready_seconds=w.spawn_to_ready_s,
                                up=float(w.alive), load=n / w.capacity if w.capacity else float(n > 0))


def start_controller(workers: Sequence[WorkerConfig] = (), *, config: ControllerConfig | None = None,
                     name: str = CONTROLLER_NAME, worker_options: Mapping[str, Any] | None = None,
                     detached: bool = False) -> Any:
    """Start the controller actor (named ``name``, so a front end finds it with :func:`get_controller`)
    and one worker per config, in parallel; returns its handle once every worker is ready."""
    opts: dict[str, Any] = {"name": name, "num_cpus": 0, "max_concurrency": 1000}
    if detached:
        opts["lifetime"] = "detached"
    if config is not None and config.restartable:  # restarted on death, under its name: it adopts its workers
        opts["max_restarts"] = -1
    handle: Any = ray.remote(ServeController).options(**opts).remote(config)
    ray.get([handle.add_worker.remote(cfg, f"worker-{i}", worker_options) for i, cfg in enumerate(workers)])
    return handle


def get_controller(name: str = CONTROLLER_NAME, namespace: str | None = None) -> Any:
    """The running controller's handle (the front end's way in)."""
    return ray.get_actor(name, namespace=namespace)
