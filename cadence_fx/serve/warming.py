"""A worker's capacity growing while its lanes are still being captured.

A worker started with ``WorkerConfig.serve_from_lanes`` is ready (and joins the controller) once its
first lanes are captured; the others capture on a thread of its own and come online one by one. Its
status then admits only the capacity of the lanes online (``WorkerStatus.capacity``; the full one is
``capacity_full``). For each such worker, at its join or its adoption by a restarted controller, the
controller starts one task that waits for every lane (``ConversationWorker.wait_lanes``), then takes
the worker's full capacity and status and wakes the admissions waiting for room (``open(wait_s=...)``).
A capture that failed leaves the worker serving on the lanes it has, at the capacity it joined with
(a warning says why); a worker that died or was removed meanwhile is left alone.

:class:`Warming` is mixed into :class:`~cadence_fx.serve.controller.ServeController`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable

from ray.exceptions import RayActorError

from cadence_fx.serve.tables import WorkerRow

__all__ = ["Warming", "lanes_online"]

log = logging.getLogger("cadence_fx.serve")


def lanes_online(status: Any) -> int:
    """The lanes a worker serves on now (every lane for a status that does not say: an older worker)."""
    return int(getattr(status, "lanes_online", status.lanes))


class Warming:
    """:meth:`_watch_lanes`, mixed into the controller (see the module docstring)."""

    if TYPE_CHECKING:
        _workers: dict[str, WorkerRow]

        def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...
        async def _notify_room(self) -> None: ...

    def _watch_lanes(self) -> None:
        """A task for each live worker with lanes still capturing and none yet (called from a running loop)."""
        for w in self._workers.values():
            if w.alive and not w.lanes_watched and lanes_online(w.status) < w.lanes:
                w.lanes_watched = True
                self._spawn(self._all_lanes(w))

    async def _all_lanes(self, w: WorkerRow) -> None:
        try:
            status = await w.handle.wait_lanes.remote()
        except RayActorError:  # it died meanwhile: its next chunk or ping fails it over
            return
        except Exception as e:  # a capture failed: it serves on, on the lanes it has
            if w.alive:
                log.warning("worker %s: its lanes past the first %d stay offline, capacity %d (%s)", w.name,
                            lanes_online(w.status), w.capacity, str(e).strip().splitlines()[-1][:300])
            return
        if not w.alive or self._workers.get(w.name) is not w:  # died, or removed, meanwhile
            return
        w.capacity, w.status = status.capacity, status
        log.info("worker %s: all %d lane(s) online, capacity %d (%.2f s after its construction)", w.name,
                 status.lanes, status.capacity, getattr(status, "lanes_ready_s", None) or float("nan"))
        await self._notify_room()
