"""A router in the caller's process: every chunk straight to the worker that holds its conversation.

Why: through the controller a chunk takes two actor hops (client to controller to worker and back),
5-8 ms added at p50 on the project's 2-core machine, and the controller, one actor, sees every chunk
of every conversation. A :class:`Router` lives where the chunks come from (a front-end replica through
:class:`~cadence_fx.serve.ray_backend.RayBackend`, or any driver) and asks the controller once for a
conversation's placement (:class:`~cadence_fx.serve.conversation.Placement`: the worker's handle and
an epoch, the fence token), then sends each chunk to that worker: one hop.

The journal (each chunk's inputs and the SHA-256 of its outputs, since the last checkpoint) is what a
failover re-runs, so it must outlive the worker. It lives here, in the router's process, because that
is where the chunks come from and their answers go: a chunk answered to the router is in its journal
before the caller has it, with no message on the chunk's path. Sending each entry to the controller
instead would put a second actor call beside every chunk and leave a window (an entry in flight when
the worker dies) that the router would have to cover anyway. If the router's process dies, its
caller's connection is gone with it (a front end's conversations are bound to their connection).
The checkpoints stay the controller's: every K chunks and after a turn's last chunk (the
controller's :class:`~cadence_fx.serve.checkpoints.CheckpointPolicy`) the router asks for one without
waiting for it, and drops the journal's entries before it once it is done. The chunks' latencies go
to the controller in batches (``report``), after the chunks were answered, for its metrics.

A worker refuses a chunk sent under a placement that is not the conversation's any more (frozen for a
move, moved, placed again after a failover) with :class:`~cadence_fx.serve.conversation.Fenced`, and
applies nothing; a dead worker's call raises ``RayActorError``. Either way the router asks the
controller where the conversation is now (``reroute``, with its journal: after a failover the new
worker re-runs the chunks since the checkpoint first) and sends the chunk there, once per chunk.
Sequence numbers keep every chunk exactly once: a refused chunk changed nothing, an answered one is in
the journal, and one whose worker died unanswered is sent again.

The logic is written once, as plans that yield the Ray calls they wait on: :meth:`Router.step` and the
other plain methods run a plan with ``ray.get`` (a driver, a thread), :meth:`Router.astep` and the other
``a``-methods with ``await`` (an event loop: the front end). One chunk at a time per conversation (as
the front end's protocol has it): a worker refuses any other number anyway. The router keeps a
reference to each chunk's inputs until a checkpoint covers it: do not write them in place (a re-run of
changed inputs is refused as ``ReplayDiverged``, never silent).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generator, Mapping, Sequence, TypeVar

import ray
from ray.exceptions import RayActorError

from cadence_fx.serve import wire
from cadence_fx.serve.checkpoints import CheckpointPolicy, JournalEntry
from cadence_fx.serve.conversation import ConversationState, Fenced, Placement, StepResult, UnknownConversation

__all__ = ["REPORT_EVERY", "Router"]

log = logging.getLogger("cadence_fx.serve")

REPORT_EVERY = 16  # chunks of latencies per report to the controller
REFUSED = (Fenced, RayActorError)  # the placement is not the conversation's now: ask again, send once more

T = TypeVar("T")
Plan = Generator[Any, Any, T]  # yields object refs, is sent what each resolved to (or thrown its error)


@dataclass
class _Route:
    """One conversation as this router sees it."""

    placement: Placement
    next_seq: int = 0  # the next chunk this router sends
    journal: list[JournalEntry] = field(default_factory=list)  # answered since the last checkpoint it saw
    since: int = 0  # chunks since the last checkpoint it asked for
    due: bool = False  # a turn ended: a checkpoint once none is pending
    pending: Future | None = None  # the checkpoint asked for: its chunk number when done
    timings: list[tuple[float, float]] = field(default_factory=list)  # (latency, worker seconds) to report


class Router:
    """Conversations of the controller ``controller`` (an actor handle), chunks sent straight to their
    workers (see the module docstring). ``policy``: when to ask for checkpoints (default: the
    controller's). Thread-safe across conversations."""

    def __init__(self, controller: Any, *, policy: CheckpointPolicy | None = None,
                 report_every: int = REPORT_EVERY) -> None:
        wire.install()  # chunks and outputs cross as numpy arrays
        self.controller = controller
        self.policy = policy if policy is not None else ray.get(controller.checkpoint_policy.remote())
        self.report_every = report_every
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()  # chunks, rerouted, checkpoints

    # ------------------------------------------------------------------ plain (ray.get)
    def open(self, conv_id: str, seed: int | None = None, prompt: Any = None, *, wait_s: float = 0.0,
             worker: str | None = None) -> dict[str, Any]:
        """Open ``conv_id`` through the controller (``ServeController.open``'s arguments), for this router."""
        return _run(self._open(conv_id, seed, prompt, wait_s, worker))

    def step(self, conv_id: str, seq: int, inputs: Sequence[Any] | Mapping[str, Any], *,
             end_of_turn: bool = False) -> StepResult:
        """Chunk ``seq`` of ``conv_id`` on the worker holding its state (``end_of_turn``: a checkpoint follows)."""
        return _run(self._step(conv_id, seq, inputs, end_of_turn))

    def keep_snapshot(self, conv_id: str) -> dict[str, Any]:
        """``ServeController.keep_snapshot``: ``{"token", "seq"}`` (the state stays in the object store)."""
        return _run(self._keep_snapshot(conv_id))

    def restore(self, conv_id: str, state: ConversationState | str) -> int:
        """Rewind ``conv_id`` to ``state`` (or a token of :meth:`keep_snapshot`): the next chunk's number."""
        return _run(self._restore(conv_id, state))

    def close(self, conv_id: str) -> None:
        """Close ``conv_id`` (through the controller) and forget it."""
        _run(self._close(conv_id))

    # ------------------------------------------------------------------ async (await)
    async def aopen(self, conv_id: str, seed: int | None = None, prompt: Any = None, *, wait_s: float = 0.0,
                    worker: str | None = None) -> dict[str, Any]:
        return await _arun(self._open(conv_id, seed, prompt, wait_s, worker))

    async def astep(self, conv_id: str, seq: int, inputs: Sequence[Any] | Mapping[str, Any], *,
                    end_of_turn: bool = False) -> StepResult:
        return await _arun(self._step(conv_id, seq, inputs, end_of_turn))

    async def akeep_snapshot(self, conv_id: str) -> dict[str, Any]:
        return await _arun(self._keep_snapshot(conv_id))

    async def arestore(self, conv_id: str, state: ConversationState | str) -> int:
        return await _arun(self._restore(conv_id, state))

    async def aclose(self, conv_id: str) -> None:
        await _arun(self._close(conv_id))

    # ------------------------------------------------------------------ reading
    def placement(self, conv_id: str) -> Placement:
        """The placement this router sends ``conv_id``'s chunks to (cached)."""
        return self._route(conv_id).placement

    def journal(self, conv_id: str) -> list[int]:
        """The chunk numbers this router keeps for ``conv_id`` (since the last checkpoint it saw)."""
        return [e.seq for e in self._route(conv_id).journal]

    def open_count(self) -> int:
        with self._lock:
            return len(self._routes)

    def checkpointed(self, conv_id: str, timeout: float | None = None) -> int | None:
        """Wait (up to ``timeout`` seconds) for the checkpoint this router last asked for ``conv_id``, if
        one is pending: the chunk number a resume would start at (the journal keeps only the chunks from
        there on), or ``None`` when none was pending. Call it between two of the conversation's chunks.
        A checkpoint is asked for without waiting, so the chunks sent meanwhile may land before it or
        after; waiting fixes the base, and a resume then re-runs every chunk answered after this one."""
        route = self._route(conv_id)
        pending = route.pending
        if pending is None:
            return None
        pending.result(timeout)  # its error, if it failed, is the caller's (the journal stays whole)
        return self._checkpoint_done(route, pending)

    # ------------------------------------------------------------------ the plans
    def _open(self, conv_id: str, seed: int | None, prompt: Any, wait_s: float, worker: str | None) -> Plan[dict[str, Any]]:
        opened: dict[str, Any] = yield self.controller.open.remote(conv_id, seed, prompt, wait_s=wait_s,
                                                                   worker=worker, routed=True)
        with self._lock:
            self._routes[conv_id] = _Route(opened["placement"])
        return opened

    def _step(self, conv_id: str, seq: int, inputs: Any, end_of_turn: bool) -> Plan[StepResult]:
        t0 = time.perf_counter()
        route = self._routes.get(conv_id)
        if route is None:
            route = self._not_mine(conv_id, (yield self.controller.placement.remote(conv_id)))
        try:
            res: StepResult = yield self._send(route, seq, inputs)
        except REFUSED as e:
            yield from self._reroute(conv_id, route, seq, e)
            res = yield self._send(route, seq, inputs)  # once: a second refusal goes to the caller
        self._answered(conv_id, route, seq, inputs, res, t0, end_of_turn)
        return res

    def _keep_snapshot(self, conv_id: str) -> Plan[dict[str, Any]]:
        route = self._route(conv_id)
        try:
            kept: dict[str, Any] = yield self.controller.keep_snapshot.remote(conv_id)
        except Fenced as e:  # resumed after a failure, behind this router's journal: catch it up first
            yield from self._reroute(conv_id, route, route.next_seq, e)
            kept = yield self.controller.keep_snapshot.remote(conv_id)
        return kept

    def _restore(self, conv_id: str, state: ConversationState | str) -> Plan[int]:
        route = self._route(conv_id)
        seq: int = yield self.controller.restore.remote(conv_id, state)
        # the restored state is the conversation's base now: the journal (the abandoned future) goes,
        # and so does a checkpoint asked for before (its number is of that future)
        route.next_seq, route.journal, route.pending, route.since, route.due = seq, [], None, 0, False
        return seq

    def _close(self, conv_id: str) -> Plan[None]:
        with self._lock:
            route = self._routes.pop(conv_id, None)
        if route is not None and route.timings:
            self.controller.report.remote(conv_id, route.placement.worker, route.timings)
        yield self.controller.close.remote(conv_id)

    # ------------------------------------------------------------------ inside
    def _route(self, conv_id: str) -> _Route:
        route = self._routes.get(conv_id)
        if route is None:
            raise UnknownConversation(f"conversation {conv_id!r} is not open on this router")
        return route

    def _not_mine(self, conv_id: str, _placement: Placement) -> _Route:
        raise UnknownConversation(f"conversation {conv_id!r} was not opened by this router (its chunks and "
                                  "journal belong to the router that opened it)")

    @staticmethod
    def _send(route: _Route, seq: int, inputs: Any) -> Any:
        p = route.placement
        return p.handle.step.remote(p.conv_id, seq, inputs, p.epoch)

    def _reroute(self, conv_id: str, route: _Route, seq: int, why: BaseException) -> Plan[None]:
        """Ask the controller where ``conv_id`` is now (after ``why``), handing it the journal."""
        old = route.placement
        log.info("conversation %s: chunk %d refused by %s under epoch %d (%s): asking the controller", conv_id, seq,
                 old.worker, old.epoch, type(why).__name__)
        self.stats["rerouted"] += 1
        if route.timings:  # the latencies so far were the old worker's
            self.controller.report.remote(conv_id, old.worker, route.timings)
            route.timings = []
        route.placement = yield self.controller.reroute.remote(conv_id, old.epoch, seq, list(route.journal))

    def _answered(self, conv_id: str, route: _Route, seq: int, inputs: Any, res: StepResult, t0: float,
                  end_of_turn: bool) -> None:
        """Journal the answered chunk; ask for a checkpoint when one is due; report latencies in batches."""
        route.journal.append(JournalEntry(seq, inputs, res.digest))
        route.next_seq = seq + 1
        route.timings.append((time.perf_counter() - t0, res.worker_s))
        self.stats["chunks"] += 1
        pending = route.pending
        if pending is not None and pending.done():
            try:
                self._checkpoint_done(route, pending)
            except Exception as e:  # the journal stays whole: the next checkpoint covers it
                log.warning("conversation %s: a checkpoint failed (%r)", conv_id, e)
        route.since += 1
        policy = self.policy
        route.due = route.due or (end_of_turn and policy.at_turn_end) or (0 < policy.every <= route.since)
        if route.due and route.pending is None:
            route.pending = self.controller.checkpoint.remote(conv_id).future()
            route.due, route.since = False, 0
            self.stats["checkpoints"] += 1
        if len(route.timings) >= self.report_every:
            self.controller.report.remote(conv_id, res.worker, route.timings)
            route.timings = []

    @staticmethod
    def _checkpoint_done(route: _Route, pending: Future) -> int:
        """``pending`` (done) was the checkpoint asked for: the journal drops the chunks before it."""
        if route.pending is pending:
            route.pending = None
        done = int(pending.result())
        route.journal = [e for e in route.journal if e.seq >= done]
        return done


class _Done:
    """A plan's result (what :func:`_advance` gives back once the plan returned)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _advance(plan: Plan[Any], ok: bool, value: Any) -> Any:
    """Hand ``plan`` the outcome of its last call (what it returned, or the error it raised): its next
    call, or :class:`_Done` with its result."""
    try:
        return plan.send(value) if ok else plan.throw(value)
    except StopIteration as done:
        return _Done(done.value)


def _run(plan: Plan[T]) -> T:
    """Run ``plan`` in this thread, waiting on each of its calls with ``ray.get``."""
    ok, value = True, None
    while not isinstance(call := _advance(plan, ok, value), _Done):
        ok, value = _got(call)
    return call.value  # type: ignore[no-any-return]


def _got(ref: Any) -> tuple[bool, Any]:
    try:
        return True, ray.get(ref)
    except Exception as e:  # handed to the plan, which raises it or handles it
        return False, e


async def _arun(plan: Plan[T]) -> T:
    """Run ``plan`` on the running event loop, awaiting each of its calls."""
    ok, value = True, None
    while not isinstance(call := _advance(plan, ok, value), _Done):
        ok, value = await _awaited(call)
    return call.value  # type: ignore[no-any-return]


async def _awaited(ref: Any) -> tuple[bool, Any]:
    try:
        return True, await ref
    except Exception as e:  # handed to the plan, which raises it or handles it
        return False, e
