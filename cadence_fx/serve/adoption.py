"""A restarted controller adopting the workers and conversations its previous instance left.

With ``ControllerConfig.restartable`` the controller's workers outlive it: each is started detached
and named after the controller (``<controller>.<worker>``), where otherwise Ray fate-shares the actors
an actor starts with it, so a lost controller took every worker and session with it. Ray restarts
the controller (``max_restarts``) under the same name and handle; its constructor then finds those
workers by name and rebuilds its tables from them (:meth:`Adoption._adopt`):

- each live worker's status (capacity, lanes) and its conversations' placement facts (epoch, next
  chunk, seed, whether a router was sending its chunks: ``ConversationWorker.conversation_table``);
  a worker whose lanes are still capturing is adopted at the capacity of those online, and grows to
  its full one as for a worker that joins (:mod:`cadence_fx.serve.warming`: the task starts with the
  restarted instance's first ``open`` or ``status``);
- a conversation found on two workers (its controller died during a move) keeps the copy of the
  higher epoch, the target's: the other is closed as moved. One found frozen alone (a move that never
  reached its target) is thawed;
- every adopted conversation is checkpointed at once: the old checkpoints were the old instance's
  objects (Ray frees what a dead owner put), so without a new one no failover could rebuild it. A
  conversation that cannot be checkpointed keeps a base with no state, and a resume of it is refused
  with a clear error instead of rebuilding it from the wrong base.

Routers keep streaming straight to the workers while the controller is away (their placements stay
valid: the epochs are the workers'); a checkpoint they ask for meanwhile fails and their journal
stays whole, which the next one trims. What a dead controller's own routing held (the journals of
conversations whose chunks went through it) is gone: the checkpoint at adoption is their new base.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cadence_fx.serve.checkpoints import Base, Journal, put_checkpoint
from cadence_fx.serve.tables import ConvRow, WorkerRow

if TYPE_CHECKING:
    from cadence_fx.serve.metrics import ServeMetrics

__all__ = ["Adoption", "worker_actor_name"]

log = logging.getLogger("cadence_fx.serve")

_CALL_S = 30.0  # a worker that does not answer its status and table in this long is left out


def worker_actor_name(controller: str, worker: str) -> str:
    """The Ray name of a restartable controller's worker: how its restarted instance finds it."""
    return f"{controller}.{worker}"


class Adoption:
    """:meth:`_adopt`, mixed into :class:`~cadence_fx.serve.controller.ServeController`."""

    if TYPE_CHECKING:
        config: Any
        metrics: ServeMetrics
        _workers: dict[str, Any]
        _convs: dict[str, Any]
        adopted: dict[str, Any]

    def _adopt(self, controller: str) -> None:
        """Rebuild the tables from the workers named after ``controller`` (see the module docstring);
        blocking, in the constructor, before any call is taken."""
        t0 = time.perf_counter()
        prefix = worker_actor_name(controller, "")
        copies: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
        for full in sorted(ray.util.list_named_actors()):
            if not full.startswith(prefix):
                continue
            name = full[len(prefix):]
            try:
                handle = ray.get_actor(full)
                status, table = ray.get([handle.status.remote(), handle.conversation_table.remote()], timeout=_CALL_S)
            except (ValueError, RayActorError, GetTimeoutError) as e:
                log.warning("adoption: worker %s left out (%s)", full, e)
                continue
            self._workers[name] = WorkerRow(name, handle, status.capacity, status.lanes,
                                            status.calibration.deadline_ms / 1e3, status.ready_s, status)
            for cid, facts in table.items():
                copies.setdefault(cid, []).append((int(facts["epoch"]), name, facts))
        closed, thawed, checkpointed, unprotected = 0, 0, 0, []
        for cid, found in copies.items():
            found.sort(key=lambda c: c[0], reverse=True)
            epoch, name, facts = found[0]
            for _e, other, _f in found[1:]:  # the source of a move the old instance did not close
                closed += _call(self._workers[other].handle.close.remote(cid, moved=True), f"closing {cid} on {other}")
            if facts["frozen"] and len(found) == 1:  # a move that never reached its target
                thawed += _call(self._workers[name].handle.thaw.remote(cid), f"thawing {cid} on {name}")
            journal = Journal(Base(int(facts["next_seq"]), None, int(facts["seed"]), None))
            conv = ConvRow(cid, name, int(facts["seed"]), journal, asyncio.Condition(), time.monotonic(),
                           next_seq=int(facts["next_seq"]), routed=bool(facts["routed"]), epoch=epoch)
            self._convs[cid] = conv
            try:
                state = ray.get(self._workers[name].handle.export_conversation.remote(cid), timeout=_CALL_S)
                journal.checkpointed(put_checkpoint(state), state.next_seq)
                checkpointed += 1
            except (RayActorError, RayTaskError, GetTimeoutError) as e:
                unprotected.append(cid)
                log.warning("adoption: %s not checkpointed (%s): it cannot be resumed until it is", cid, e)
        self.adopted = {"workers": sorted(self._workers), "conversations": len(self._convs),
                        "checkpointed": checkpointed, "unprotected": unprotected, "closed_duplicates": closed,
                        "thawed": thawed, "seconds": time.perf_counter() - t0}
        log.info("controller %s adopted %d worker(s) and %d conversation(s) in %.2f s", controller,
                 len(self._workers), len(self._convs), self.adopted["seconds"])


def _call(ref: Any, what: str) -> int:
    try:
        ray.get(ref, timeout=_CALL_S)
        return 1
    except (RayActorError, RayTaskError, GetTimeoutError) as e:
        log.warning("adoption: %s failed (%s)", what, e)
        return 0

