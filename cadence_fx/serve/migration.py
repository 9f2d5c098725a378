"""Moving live conversations between workers: ``migrate``, ``drain`` (a deploy), ``rebalance``.

A move happens between two chunks of a conversation: the controller holds the conversation's lock,
so no chunk of its own is in flight. The source worker exports the conversation (its session's
snapshot: regions and random streams, as host tensors, with the next chunk's number) and freezes it
there: a chunk that a router sends straight to the worker (:mod:`cadence_fx.serve.router`) waits for
the export and is then refused (:class:`~cadence_fx.serve.conversation.Fenced`; the router asks the
controller and sends it to the target). The export is a Ray object whose reference the controller
passes straight to the target's ``import_conversation``, so the bytes go from the source's object
store to the target's without passing through the controller (for a state over Ray's inline limit; a
small one rides in the reference). The target restores it into a session of its own program under a
new epoch, the affinity table points at the target, and only then is the source's copy closed (as
moved: a chunk a router still sends there is fenced, not "closed"). A move that fails on the way
leaves the conversation where it was, thawed. The next chunk runs on the target and gives the bytes
the unmoved conversation would have (``tests/test_serve_ray.py`` checks the SHA-256 of whole streams).

Two workers on one GPU of one host (their status names the same node and GPU UUID) skip the host:
the source packs the conversation into one buffer on the device and the target maps it by CUDA IPC
and copies it into its session (:mod:`cadence_fx.serve.handoff`), so a move costs device-to-device
copies and three actor calls. A target that cannot map the buffer answers ``HandoffUnavailable``
and the move goes on through the object store (counted as ``handoff_fallback``).

``drain`` marks a worker as taking no new conversations and moves each of its conversations to the
least loaded other worker with room; ``rebalance`` moves conversations from workers above their share
(by capacity) to workers below it (:func:`cadence_fx.serve.placement.rebalance_moves`).

:class:`Moves` is mixed into :class:`~cadence_fx.serve.controller.ServeController`, whose tables it
reads: one job (moving), kept apart from routing and failover.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError

from cadence_fx.serve.conversation import AdmissionRefused, ConversationClosed, NoWorkers
from cadence_fx.serve.handoff import HandoffUnavailable
from cadence_fx.serve.placement import choose, rebalance_moves

if TYPE_CHECKING:
    from cadence_fx.serve.metrics import ServeMetrics
    from cadence_fx.serve.placement import WorkerView

__all__ = ["MoveReport", "Moves"]

log = logging.getLogger("cadence_fx.serve")


@dataclass(frozen=True)
class MoveReport:
    """One move: from ``source`` to ``target`` in ``seconds`` (export, transfer, import, close), the
    state's ``nbytes``, and the ``path`` its bytes took: ``device`` (handed off on one GPU) or ``host``
    (through the object store)."""

    conv_id: str
    source: str
    target: str
    seconds: float
    nbytes: int
    path: str = "host"


class Moves:
    """``migrate``, ``drain``, ``undrain`` and ``rebalance`` of the controller (see the module docstring)."""

    if TYPE_CHECKING:
        config: Any
        _workers: dict[str, Any]
        _convs: dict[str, Any]
        metrics: ServeMetrics

        def _conv(self, conv_id: str) -> Any: ...
        def _worker(self, name: str) -> Any: ...
        def _alive(self, name: str) -> bool: ...
        def _views(self) -> list[WorkerView]: ...
        async def _resume_locked(self, conv: Any) -> None: ...
        async def _probe(self, w: Any) -> bool: ...
        async def _notify_room(self) -> None: ...

    async def migrate(self, conv_id: str, target: str, *, via: str = "auto") -> MoveReport:
        """Move ``conv_id`` to worker ``target`` between two of its chunks. ``via``: ``auto`` (on the
        device where both workers share a GPU, else through the object store) or ``host`` (through
        the object store always: what a move between hosts costs)."""
        if via not in ("auto", "host"):
            raise ValueError(f"via is 'auto' or 'host', not {via!r}")
        conv = self._conv(conv_id)
        async with conv.cond:
            return await self._migrate_locked(conv, target, via)

    async def drain(self, worker: str) -> list[MoveReport]:
        """Stop admitting onto ``worker`` and move every conversation on it to other workers with room.
        Raises :class:`AdmissionRefused` (after moving what fits) when the others are full; the worker
        then stays draining with the rest."""
        self._worker(worker).draining = True
        reports, left = [], []
        for conv in [c for c in self._convs.values() if c.worker == worker]:
            try:
                target = choose(self._views(), exclude=[worker])
                reports.append(await self.migrate(conv.conv_id, target))
            except ConversationClosed:
                continue
            except (AdmissionRefused, NoWorkers) as e:
                left.append(conv.conv_id)
                log.warning("drain of %s: %s stays (%s)", worker, conv.conv_id, e)
        await self._notify_room()
        if left:
            raise AdmissionRefused(f"drain of {worker}: no room on the other workers for {left}; {len(reports)} "
                                   f"conversation(s) moved; {worker} stays draining")
        return reports

    async def undrain(self, worker: str) -> None:
        """Admit conversations onto ``worker`` again."""
        self._worker(worker).draining = False
        await self._notify_room()

    async def rebalance(self) -> list[MoveReport]:
        """Even the load: conversations move from workers above their share of the total (in proportion
        to capacity) to workers below theirs; the most recently opened move first."""
        placed: dict[str, list[str]] = {}
        for c in sorted(self._convs.values(), key=lambda c: c.opened_at):
            placed.setdefault(c.worker, []).append(c.conv_id)
        reports = []
        for conv_id, _source, target in rebalance_moves(self._views(), placed):
            try:
                reports.append(await self.migrate(conv_id, target))
            except (ConversationClosed, AdmissionRefused, NoWorkers, LookupError) as e:
                log.warning("rebalance: %s not moved to %s (%s)", conv_id, target, e)
        return reports

    async def _migrate_locked(self, conv: Any, target: str, via: str = "auto") -> MoveReport:
        if conv.closed:
            raise ConversationClosed(f"conversation {conv.conv_id!r} was closed")
        dst = self._worker(target)
        if conv.worker == target:
            return MoveReport(conv.conv_id, target, target, 0.0, 0)
        if not self._alive(conv.worker):  # its worker died: the resume is the first half of the move
            await self._resume_locked(conv)
            if conv.worker == target:
                return MoveReport(conv.conv_id, target, target, 0.0, 0)
        view = next(v for v in self._views() if v.name == target)
        if view.room <= 0:
            raise AdmissionRefused(f"cannot move {conv.conv_id!r} to {target}: " + (
                "it is dead" if not view.alive else "it is draining" if view.draining
                else f"it is at capacity ({view.conversations}/{view.capacity})"))
        src = self._workers[conv.worker]
        conv.also_on = target  # counted on the target from here (then on the source until it is closed
        # there): no open or resume takes a slot a worker's own count still holds
        try:
            return await self._move(conv, src, dst, target, via)
        finally:
            conv.also_on = None

    async def _move(self, conv: Any, src: Any, dst: Any, target: str, via: str) -> MoveReport:
        t0 = time.perf_counter()
        path = "host"
        try:
            on_device = via == "auto" and _same_device(src, dst, self.config)
            moved = await self._hand_off(conv, src, dst) if on_device else None
            if moved == _SOURCE_LOST:  # what the target read may not be the conversation: resume instead
                await self._resume_locked(conv)
                raise NoWorkers(f"moving {conv.conv_id!r} from {src.name} to {target} failed: the source died "
                                f"while the target read its buffer; the conversation is on {conv.worker}")
            if isinstance(moved, tuple):
                nbytes, next_seq, path = moved[0], moved[1], "device"
            else:
                # frozen at the source from the export on (a router's chunk there is refused: Fenced);
                # the state stays in the object store, only its header comes here
                exported, header = src.handle.checkpoint.options(num_returns=2).remote(conv.conv_id, freeze=True)
                nbytes = await dst.handle.import_conversation.remote(conv.conv_id, exported, epoch=conv.epoch + 1)
                next_seq = int((await header)["next_seq"])
        except (RayActorError, RayTaskError) as e:
            src_ok, dst_ok = await self._probe(src), await self._probe(dst)
            if not src_ok:  # the source died: resume it (from its checkpoint) instead
                await self._resume_locked(conv)
            else:
                await _thaw(src, conv.conv_id)
            if src_ok and dst_ok and isinstance(e, RayTaskError):
                raise e.as_instanceof_cause() from None
            raise NoWorkers(f"moving {conv.conv_id!r} from {src.name} to {target} failed: "
                            f"{'source' if not src_ok else 'target'} died; the conversation is on {conv.worker}") from None
        conv.worker, conv.epoch, conv.next_seq, conv.also_on = target, conv.epoch + 1, next_seq, src.name
        try:
            await src.handle.close.remote(conv.conv_id, moved=True)  # a late chunk there: Fenced, not closed
        except (RayActorError, RayTaskError) as e:  # the move is done either way
            log.warning("migration of %s: closing it on %s failed (%s)", conv.conv_id, src.name, e)
        seconds = time.perf_counter() - t0
        self.metrics.event("migration", seconds, nbytes)
        log.info("conversation %s moved %s -> %s in %.4f s (%d bytes, %s)", conv.conv_id, src.name, target, seconds,
                 nbytes, path)
        return MoveReport(conv.conv_id, src.name, target, seconds, int(nbytes), path)

    async def _hand_off(self, conv: Any, src: Any, dst: Any) -> tuple[int, int] | str | None:
        """The move on the GPU both workers share (:mod:`cadence_fx.serve.handoff`): ``(bytes, next
        chunk)``, or ``None`` where the target could not map the source's buffer (counted as
        ``handoff_fallback``; the conversation stays frozen at the source for the object store's path),
        or ``_SOURCE_LOST`` where the source was dead once the target had copied its buffer (the
        target's copy is closed: the memory of a process that exits is freed under its mappings, so
        what was read is not trusted)."""
        try:
            handoff = await src.handle.handoff.remote(conv.conv_id)  # frozen there from here on
            nbytes = await dst.handle.import_handoff.remote(conv.conv_id, handoff, epoch=conv.epoch + 1)
        except RayTaskError as e:  # either end refused the device path: nothing was opened at the target
            if not isinstance(e.as_instanceof_cause(), HandoffUnavailable):
                raise
            self.metrics.count("handoff_fallback")
            log.warning("moving %s on the device failed (%s): through the object store", conv.conv_id, e)
            return None
        # the target synchronized before it answered, so a source alive now was alive while it was read
        if not await self._probe(src):
            try:
                await dst.handle.close.remote(conv.conv_id)
            except (RayActorError, RayTaskError) as e:
                log.warning("a move of %s whose source died: closing the target's copy failed (%s)", conv.conv_id, e)
            return _SOURCE_LOST
        return int(nbytes), int(handoff.next_seq)


_SOURCE_LOST = "source lost"


def _same_device(src: Any, dst: Any, config: Any) -> bool:
    """Both workers on one GPU of one host (their status names the same node and GPU UUID)."""
    ident = getattr(src.status, "identity", None)
    return bool(config.handoff) and ident is not None and ident == getattr(dst.status, "identity", None)


async def _thaw(src: Any, conv_id: str) -> None:
    """Undo a move's freeze at a live source (the move failed at the target: the conversation stays)."""
    try:
        await src.handle.thaw.remote(conv_id)
    except (RayActorError, RayTaskError) as e:
        log.warning("a failed move of %s: thawing it on %s failed (%s)", conv_id, src.name, e)
