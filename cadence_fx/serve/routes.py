"""What a router asks the controller: a conversation's placement, and where to go after a refusal.

A router (:mod:`cadence_fx.serve.router`) lives in the caller's process and sends chunks straight to
the worker holding a conversation's state. It asks the controller only where that is
(:meth:`Routes.placement`: the worker's handle and the placement's epoch, the fence token), and again
when a worker refuses a chunk as :class:`~cadence_fx.serve.conversation.Fenced` (the conversation is
frozen for a move, moved, or placed again after a failover) or when the worker is dead
(:meth:`Routes.reroute`). Both hold the conversation's lock, so they wait for a move or a resume in
progress and answer with where it ended.

A routed conversation's journal (each chunk's inputs and output digest since the last checkpoint) is
the router's, not the controller's. When the conversation's worker died the controller resumes it
from its checkpoint alone (the base: the bulk of the state, at once, before the router comes back);
the worker is then behind the router (``lagging``), and the router's ``reroute`` brings its journal:
the chunks from the worker's position up to the router's next one are re-run there (one call), each
checked against the digest the client was sent, before the router's chunk is retried. Every chunk is
applied once: a refused chunk changed nothing, a chunk answered to the router is in its journal, and
a chunk whose worker died unanswered is re-sent by the router.

:meth:`Routes.report` takes a router's chunk latencies in batches, off the chunks' path, so the
controller's metrics cover routed conversations too. :class:`Routes` is mixed into
:class:`~cadence_fx.serve.controller.ServeController`, whose tables it reads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from ray.exceptions import RayActorError, RayTaskError

from cadence_fx.serve.checkpoints import JournalEntry, replay_checked
from cadence_fx.serve.conversation import ConversationClosed, NoWorkers, Placement, ReplayDiverged

if TYPE_CHECKING:
    from cadence_fx.serve.checkpoints import CheckpointPolicy
    from cadence_fx.serve.metrics import ServeMetrics

__all__ = ["Routes"]

log = logging.getLogger("cadence_fx.serve")


class Routes:
    """``placement``, ``reroute``, ``report`` and ``checkpoint_policy`` of the controller (see the module
    docstring)."""

    if TYPE_CHECKING:
        config: Any
        metrics: ServeMetrics
        _workers: dict[str, Any]
        _convs: dict[str, Any]

        def _conv(self, conv_id: str) -> Any: ...
        def _alive(self, name: str) -> bool: ...
        def _worker_died(self, name: str, err: BaseException | str) -> None: ...
        async def _resume_locked(self, conv: Any) -> None: ...
        async def _probe(self, w: Any) -> bool: ...

    async def checkpoint_policy(self) -> CheckpointPolicy:
        """When conversations are checkpointed (a router asks for its conversations' checkpoints)."""
        policy: CheckpointPolicy = self.config.checkpoint
        return policy

    async def placement(self, conv_id: str) -> Placement:
        """Where ``conv_id``'s state is now (after a move or a resume in progress; a closed one raises
        ``ConversationClosed``, here or at its worker)."""
        conv = self._conv(conv_id)
        async with conv.cond:
            if not self._alive(conv.worker):
                await self._resume_locked(conv)
            return self._placement(conv)

    async def reroute(self, conv_id: str, epoch: int, next_seq: int, entries: Sequence[JournalEntry]) -> Placement:
        """Where to send chunk ``next_seq`` of ``conv_id``, which the placement of ``epoch`` refused or
        lost (its worker died). ``entries``: the router's journal (every chunk it was answered since the
        last checkpoint it was told of); the ones the conversation's worker has not applied are re-run
        there first, so the worker expects ``next_seq``."""
        conv = self._conv(conv_id)
        async with conv.cond:
            if conv.closed:
                raise ConversationClosed(f"conversation {conv_id!r} was closed")
            # the same placement: the router may have seen its worker die first; if it lives, it has
            # applied every chunk the router was answered
            if conv.epoch == epoch and self._alive(conv.worker) and await self._probe(self._workers[conv.worker]):
                conv.next_seq = max(conv.next_seq, next_seq)
            for _attempt in range(len(self._workers) + 1):
                if not self._alive(conv.worker):
                    await self._resume_locked(conv)
                missing = [e for e in entries if conv.next_seq <= e.seq < next_seq]
                if [e.seq for e in missing] != list(range(conv.next_seq, next_seq)):
                    raise ReplayDiverged(f"conversation {conv_id!r}: its worker is at chunk {conv.next_seq}, the "
                                         f"router at {next_seq}, and the router's journal holds "
                                         f"{[e.seq for e in entries]}: the chunks between cannot be re-run")
                try:
                    await replay_checked(conv_id, self._workers[conv.worker].handle, conv.worker, missing)
                except RayActorError as e:
                    self._worker_died(conv.worker, e)
                    continue
                except RayTaskError as e:
                    raise e.as_instanceof_cause() from None
                if missing:
                    self.metrics.count("replayed_chunks", len(missing))
                    log.info("conversation %s: chunks %d..%d of its router re-run on %s", conv_id, missing[0].seq,
                             missing[-1].seq, conv.worker)
                conv.next_seq = max(conv.next_seq, next_seq)
                conv.lagging = False
                return self._placement(conv)
            raise NoWorkers(f"conversation {conv_id!r}: every worker it was resumed on died")

    async def report(self, conv_id: str, worker: str, chunks: Sequence[tuple[float, float]]) -> None:
        """A router's chunks of ``conv_id`` on ``worker``: (latency as the router saw it, the worker's own
        seconds) each, for the metrics (sent in batches, after the chunks were answered)."""
        if conv_id not in self._convs:  # closed since: its metrics are gone
            return
        w = self._workers.get(worker)
        deadline = w.deadline_s if w is not None else float("inf")
        for latency, worker_s in chunks:
            self.metrics.chunk(conv_id, worker, latency, worker_s, deadline, path="router")

    def _placement(self, conv: Any) -> Placement:
        return Placement(conv.conv_id, conv.worker, self._workers[conv.worker].handle, conv.epoch, conv.next_seq)
