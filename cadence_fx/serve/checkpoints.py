"""Failover with nothing lost: checkpoints, the journal of chunks since, and the resume.

A worker that dies takes its sessions with it. Every conversation therefore has, outside its worker,
a base it can be rebuilt from and the chunks applied since:

- the base is the conversation as opened (its seed and initial state, put in the object store once
  at ``open``), replaced by a checkpoint (:class:`~cadence_fx.serve.conversation.ConversationState`
  exported by the worker) at every turn boundary the client marks and every K chunks. Its bytes are
  put in the object store by the controller (``CheckpointPolicy.store="controller"``: it outlives the
  worker's machine) or left in the worker node's object store (``"worker"``: no copy through the
  controller; it outlives the worker's process, not its machine);
- the journal keeps each chunk applied since the base: its sequence number, its inputs, and the
  SHA-256 of the outputs the client was sent. The controller keeps it for the chunks it routes; for a
  conversation streamed by a router (:mod:`cadence_fx.serve.router`) the router keeps it, and the
  resume here imports the base alone, under a new epoch; the router's ``reroute``
  (:mod:`cadence_fx.serve.routes`) re-runs its entries through :func:`replay_checked`.

:func:`resume` rebuilds a conversation on another worker: import the base, re-run the journal's chunks
in order (one call, :meth:`ConversationWorker.replay`), and check each re-run's digest against what
the client got. A step is a pure function of (state, random streams, inputs), so the re-run is the
same bytes (a difference is :class:`~cadence_fx.serve.conversation.ReplayDiverged`, never silent).
The chunk that was in flight when the worker died was never answered, so it is simply sent to the new
worker next: the client's stream has every chunk once.

The cost trade of K: a checkpoint costs one export (a device-to-host copy of the state, its
serialization and a ``ray.put``) every K chunks; a resume re-runs on average K/2 chunks. The default
K (:data:`DEFAULT_EVERY`, 16) comes from ``benchmarks/serve.py``'s measured costs (``docs/serving.md``):
the worker's export is about a tenth of a chunk's time at every size measured (8 KiB to 32 MiB of
state), so at K = 16 checkpoints take under 1 % of a worker's time; their wall time (two Ray hops and
the copies) runs after the chunk's reply, between chunks; and a resume re-runs at most 16 chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from cadence_fx.serve.conversation import AdmissionRefused, ConversationState, NoWorkers, ReplayDiverged
from cadence_fx.serve.placement import choose

if TYPE_CHECKING:
    from cadence_fx.serve.metrics import ServeMetrics
    from cadence_fx.serve.placement import WorkerView

__all__ = ["DEFAULT_EVERY", "Base", "CheckpointPolicy", "Failover", "Journal", "JournalEntry", "ResumeReport", "put_checkpoint", "replay_checked", "resume"]

log = logging.getLogger("cadence_fx.serve")

DEFAULT_EVERY = 16


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a conversation is checkpointed: every ``every`` chunks (0: never by count) and, with
    ``at_turn_end``, after each chunk the client marks as a turn's last.

    ``store``: where a checkpoint's bytes live. ``"controller"`` (default): fetched by the controller
    and put in its own node's object store, so a checkpoint outlives the worker's machine; it costs a
    copy through the controller process. ``"worker"``: left where the worker's export put them (the
    export's return value, owned by the controller, its bytes in the object store of the worker's
    node): no copy through the controller, and a checkpoint outlives the worker's process (a kill, a
    crash, the OOM killer), not its machine."""

    every: int = DEFAULT_EVERY
    at_turn_end: bool = True
    store: str = "controller"

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"CheckpointPolicy.every must be >= 0, got {self.every}")
        if self.store not in ("controller", "worker"):
            raise ValueError(f"CheckpointPolicy.store is 'controller' or 'worker', got {self.store!r}")


@dataclass(frozen=True)
class Base:
    """What a resume starts from: a checkpoint (``state``: an object ref of a ``ConversationState``)
    or, before the first one, the conversation as opened (``seed`` and ``prompt``, a ref or ``None``).
    ``seq``: the next chunk's number at the base."""

    seq: int
    state: Any = None
    seed: int | None = None
    prompt: Any = None


@dataclass(frozen=True)
class JournalEntry:
    seq: int
    inputs: Any
    digest: str


@dataclass
class Journal:
    """One conversation's base and the chunks applied since it."""

    base: Base
    entries: list[JournalEntry] = field(default_factory=list)
    checkpoints: int = 0

    @classmethod
    def opened(cls, seed: int | None, prompt: Any) -> "Journal":
        return cls(Base(0, None, seed, prompt))

    def record(self, seq: int, inputs: Any, digest: str) -> None:
        """Chunk ``seq`` was applied and answered with outputs of ``digest``."""
        self.entries.append(JournalEntry(seq, inputs, digest))

    def due(self, policy: CheckpointPolicy, end_of_turn: bool) -> bool:
        """Whether a checkpoint is due after the chunk just recorded."""
        if not self.entries:
            return False
        return (end_of_turn and policy.at_turn_end) or (policy.every > 0 and len(self.entries) >= policy.every)

    def checkpointed(self, state_ref: Any, next_seq: int) -> None:
        """A checkpoint of the conversation at ``next_seq`` is in the object store: the journal keeps
        only what came after it."""
        self.base = Base(next_seq, state_ref, self.base.seed, None)
        self.entries = [e for e in self.entries if e.seq >= next_seq]
        self.checkpoints += 1

    def rebased(self, state_ref: Any, next_seq: int) -> None:
        """The conversation was rewound to a snapshot at ``next_seq`` (a restore): that snapshot is the
        base, and every journal chunk (of the abandoned future) goes."""
        self.base = Base(next_seq, state_ref, self.base.seed, None)
        self.entries = []
        self.checkpoints += 1


@dataclass(frozen=True)
class ResumeReport:
    conv_id: str
    worker: str
    replayed: int
    seconds: float
    base_seq: int


async def resume(conv_id: str, journal: Journal, handle: Any, worker: str, *, overcommit: bool,
                 epoch: int = 0) -> ResumeReport:
    """Rebuild ``conv_id`` on ``handle`` (under placement ``epoch``) from its journal: the base, then
    every chunk since, each checked against the digest the client's copy had. Raises
    ``ray.exceptions.RayActorError`` when the target dies too (the caller picks another),
    :class:`ReplayDiverged` on other bytes."""
    t0 = time.perf_counter()
    base = journal.base
    if base.state is None and base.seq > 0:  # adopted by a restarted controller, not checkpointed since
        raise NoWorkers(f"conversation {conv_id!r} has no checkpoint to resume from (its controller restarted "
                        f"at chunk {base.seq} and could not checkpoint it since)")
    if base.state is not None:
        await handle.import_conversation.remote(conv_id, base.state, replace=True, force=overcommit, epoch=epoch)
    else:
        await handle.open.remote(conv_id, base.seed, base.prompt, replace=True, force=overcommit, epoch=epoch)
    entries = [e for e in journal.entries if e.seq >= base.seq]
    await replay_checked(conv_id, handle, worker, entries)
    return ResumeReport(conv_id, worker, len(entries), time.perf_counter() - t0, base.seq)


async def replay_checked(conv_id: str, handle: Any, worker: str, entries: Sequence[JournalEntry]) -> None:
    """Re-run ``entries`` on ``handle`` in order (one call), each checked against the digest of what the
    client was sent: :class:`ReplayDiverged` on other bytes, never a silent change."""
    if not entries:
        return
    digests = await handle.replay.remote(conv_id, [(e.seq, e.inputs) for e in entries])
    for e, d in zip(entries, digests):
        if d != e.digest:
            raise ReplayDiverged(f"conversation {conv_id!r}: chunk {e.seq} re-run on {worker} after a "
                                 f"failover gave outputs of SHA-256 {d[:16]}..., the client was sent "
                                 f"{e.digest[:16]}...: the step is not a function of its state and inputs")


def put_checkpoint(state: Any) -> Any:
    """A checkpoint into the object store, owned by the calling process (the controller): it outlives
    the worker that exported it and that worker's machine."""
    return ray.put(state)


class Failover:
    """The controller's failover (mixed into :class:`~cadence_fx.serve.controller.ServeController`, whose
    tables it reads): finding dead workers (a call's ``RayActorError``, or a ping), fencing them, and
    resuming their conversations; taking checkpoints."""

    if TYPE_CHECKING:
        config: Any
        metrics: ServeMetrics
        _workers: dict[str, Any]
        _convs: dict[str, Any]
        _resumes: Any

        def _spawn(self, coro: Any) -> Any: ...
        def _alive(self, name: str) -> bool: ...
        def _views(self) -> list[WorkerView]: ...
        async def _on_worker(self, conv: Any, make: Callable[[Any], Awaitable[Any]]) -> Any: ...

    async def check_workers(self) -> list[str]:
        """Ping every live worker; the ones that do not answer are fenced and failed over."""
        live = [w for w in self._workers.values() if w.alive]
        results = await asyncio.gather(*(self._probe(w) for w in live))
        return [w.name for w, ok in zip(live, results) if not ok]

    async def resumes(self) -> list[dict[str, Any]]:
        """Every resume after a failure: conversation, from, to, chunks re-run, seconds."""
        return list(self._resumes)

    def _worker_died(self, name: str, err: BaseException | str) -> None:
        """Fence ``name`` (never used again: killed, in case it is only unreachable) and resume each of
        its conversations elsewhere (eagerly: an idle conversation is ready before its next chunk)."""
        w = self._workers.get(name)
        if w is None or not w.alive:
            return
        w.alive, w.died_at = False, time.perf_counter()
        self.metrics.count("failovers")
        orphans = [c for c in self._convs.values() if c.worker == name]
        log.warning("worker %s is dead (%s); resuming its %d conversation(s) elsewhere", name,
                    str(err).splitlines()[0][:200], len(orphans))
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # already gone
            pass
        for conv in orphans:
            self._spawn(self._resume_task(conv))

    async def _resume_task(self, conv: Any) -> None:
        async with conv.cond:
            if not conv.closed and not self._alive(conv.worker):
                try:
                    await self._resume_locked(conv)
                except NoWorkers as e:  # resumed when a worker joins, or by its next chunk
                    log.error("conversation %s waits for a worker: %s", conv.conv_id, e)

    async def _resume_locked(self, conv: Any) -> None:
        source = conv.worker
        died_at = self._workers[source].died_at if source in self._workers else None
        refused: list[str] = []  # workers that said they were full though the views gave them room
        for _attempt in range(2 * len(self._workers) + 1):
            views = self._views()
            try:
                target, over = choose(views, exclude=refused), False
            except (AdmissionRefused, NoWorkers):  # NoWorkers again below when none is alive at all
                target, over = choose(views, overcommit=True), True
                self.metrics.count("overcommit")
                log.warning("no worker has room to resume %s: placed on %s past its capacity", conv.conv_id, target)
            conv.worker = target  # counted in the views of concurrent resumes
            w = self._workers[target]
            try:
                report = await resume(conv.conv_id, conv.journal, w.handle, target, overcommit=over,
                                      epoch=conv.epoch + 1)
            except RayActorError as e:
                self._worker_died(target, e)
                continue
            except RayTaskError as e:
                # the target holds no state of it: the conversation stays with its dead worker (resumed
                # again by its next call), never on a live worker that would answer "unknown"
                conv.worker = source
                cause = e.as_instanceof_cause()
                if isinstance(cause, AdmissionRefused) and not over:
                    # its count ran ahead of ours (a conversation opened on it straight, a move in
                    # flight): the next worker with room, else past a capacity
                    refused.append(target)
                    log.warning("resume of %s refused by %s (%s); trying another", conv.conv_id, target, cause)
                    continue
                raise cause from None
            conv.epoch += 1  # a new placement: chunks sent under the old one are refused
            if conv.routed:  # the worker is at the base; the router's journal has the chunks since
                conv.next_seq, conv.lagging = report.base_seq + report.replayed, True
            self.metrics.event("resume", report.seconds)
            self.metrics.count("replayed_chunks", report.replayed)
            since = time.perf_counter() - died_at if died_at is not None else None
            self._resumes.append({"conv_id": conv.conv_id, "from": source, "to": target, "replayed": report.replayed,
                                  "base_seq": report.base_seq, "resume_s": report.seconds, "since_detected_s": since})
            log.info("conversation %s resumed on %s from chunk %d (+%d re-run) in %.3f s", conv.conv_id, target,
                     report.base_seq, report.replayed, report.seconds)
            return
        raise NoWorkers(f"conversation {conv.conv_id!r}: every worker it was resumed on died")

    async def _checkpoint_task(self, conv: Any) -> None:
        async with conv.cond:
            if not conv.closed and self._alive(conv.worker):
                await self._checkpoint_locked(conv)

    async def _checkpoint_locked(self, conv: Any, store: str | None = None) -> int:
        t0 = time.perf_counter()
        if (store or self.config.checkpoint.store) == "worker":
            async def left_there(h: Any) -> tuple[Any, dict[str, Any]]:
                state_ref, meta_ref = h.checkpoint.options(num_returns=2).remote(conv.conv_id)
                return state_ref, await meta_ref  # only the small half comes here

            ref, meta = await self._on_worker(conv, left_there)
            seq, nbytes = int(meta["next_seq"]), int(meta["nbytes"])
        else:
            state: ConversationState = await self._on_worker(conv, lambda h: h.export_conversation.remote(conv.conv_id))
            ref, seq, nbytes = put_checkpoint(state), state.next_seq, state.nbytes()
        conv.journal.checkpointed(ref, seq)
        self.metrics.event("checkpoint", time.perf_counter() - t0, nbytes)
        return seq


    async def _probe(self, w: Any) -> bool:
        try:
            await asyncio.wait_for(w.handle.ping.remote(), self.config.health_timeout_s)
            return True
        except (RayActorError, asyncio.TimeoutError) as e:
            self._worker_died(w.name, e if isinstance(e, RayActorError) else
                              f"no answer to a ping in {self.config.health_timeout_s:g} s")
            return False

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_workers()
