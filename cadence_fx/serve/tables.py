"""The controller's tables: one row per worker and one per conversation.

Kept apart from :mod:`cadence_fx.serve.controller` so that the controller's parts (moves, failover,
routes, turns, a restart's adoption) share one definition of what the controller knows.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any

from cadence_fx.serve.checkpoints import Journal
from cadence_fx.serve.worker import WorkerStatus

__all__ = ["ConvRow", "WorkerRow"]


@dataclass
class WorkerRow:
    """A worker as the controller tracks it."""

    name: str
    handle: Any
    capacity: int
    lanes: int
    deadline_s: float
    spawn_to_ready_s: float
    status: WorkerStatus
    alive: bool = True
    draining: bool = False
    in_flight: int = 0
    died_at: float | None = None
    lanes_watched: bool = False  # a task waits for its lanes still capturing (serve.warming)


@dataclass
class ConvRow:
    """A conversation as the controller tracks it."""

    conv_id: str
    worker: str
    seed: int
    journal: Journal
    cond: asyncio.Condition
    opened_at: float
    next_seq: int = 0  # a routed one's: the worker's at its placement (the router's journal has the rest)
    closed: bool = False
    routed: bool = False  # its chunks come from a router, which keeps the journal since the base
    epoch: int = 0  # the placement's fence token: +1 at every move and resume
    lagging: bool = False  # routed, resumed, and the router's journal not re-run yet
    also_on: str | None = None  # during a move, the other worker with a copy: its slot counts there
    snapshots: collections.OrderedDict[str, tuple[Any, int]] = field(default_factory=collections.OrderedDict)
