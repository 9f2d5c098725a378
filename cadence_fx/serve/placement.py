"""Where a conversation goes: admission, the choice of a worker, and the moves that even the load.

Pure decisions over the controller's view of its workers (no Ray, no I/O), so each rule is tested
alone. The rules:

- A conversation is admitted only onto a live, non-draining worker below its capacity, and a
  worker's capacity is the number it measured (or was given) for its deadline: admitting past it is
  admitting into deadline misses for every conversation there. When no worker has room, the refusal
  says so with every worker's load (:func:`refusal`), never a silent queue that grows.
- Among workers with room, the least loaded by fraction of capacity (then fewest conversations, then
  name), so workers of different capacities fill evenly and a new GPU takes the next conversations.
- A resume after a failure may go past capacity (``overcommit=True``) when no worker has room: a
  conversation that lost its worker is kept (late chunks) rather than dropped (lost audio). The
  controller counts and logs it.
- :func:`rebalance_moves` moves conversations from workers above their share (total conversations
  split in proportion to capacity) to workers below theirs, one at a time, never onto a full worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from cadence_fx.serve.conversation import AdmissionRefused, NoWorkers

__all__ = ["WorkerView", "choose", "rebalance_moves", "refusal"]


@dataclass(frozen=True)
class WorkerView:
    """One worker as placement sees it: conversations placed (reserved included), capacity, state."""

    name: str
    conversations: int
    capacity: int
    alive: bool = True
    draining: bool = False

    @property
    def eligible(self) -> bool:
        return self.alive and not self.draining and self.capacity > 0

    @property
    def room(self) -> int:
        return max(0, self.capacity - self.conversations) if self.eligible else 0

    @property
    def load(self) -> float:
        return self.conversations / self.capacity if self.capacity else math.inf


def _order(w: WorkerView) -> tuple[float, int, str]:
    return (w.load, w.conversations, w.name)


def choose(views: Iterable[WorkerView], *, exclude: Sequence[str] = (), overcommit: bool = False) -> str:
    """The worker for one more conversation.

    Raises :class:`AdmissionRefused` (every worker is at capacity: the message lists them) or, with
    ``overcommit``, picks the least loaded live worker past its capacity; :class:`NoWorkers` when no
    live worker is left at all.
    """
    pool = [w for w in views if w.name not in exclude]
    roomy = [w for w in pool if w.room > 0]
    if roomy:
        return min(roomy, key=_order).name
    live = [w for w in pool if w.alive and not w.draining]
    if not live:
        raise NoWorkers("no live worker to place a conversation on" +
                        (f" (excluded: {sorted(exclude)})" if exclude else ""))
    if overcommit:
        return min(live, key=_order).name
    raise AdmissionRefused(refusal(pool))


def refusal(views: Iterable[WorkerView]) -> str:
    """Why a conversation is refused: every worker's conversations against its capacity."""
    parts = []
    for w in sorted(views, key=lambda v: v.name):
        why = "dead" if not w.alive else "draining" if w.draining else f"{w.conversations}/{w.capacity}"
        parts.append(f"{w.name}: {why}")
    return ("every worker is at capacity (conversations/capacity measured against its deadline; one more "
            "would be admitted into deadline misses): " + ", ".join(parts))


def rebalance_moves(views: Iterable[WorkerView], placed: Mapping[str, Sequence[str]]) -> list[tuple[str, str, str]]:
    """``(conversation, from, to)`` moves that bring every eligible worker within one conversation of
    its share (the total split in proportion to capacity). ``placed``: conversations by worker, in the
    order they should move (the last first)."""
    pool = {w.name: w for w in views if w.eligible}
    total = sum(w.conversations for w in pool.values())
    cap = sum(w.capacity for w in pool.values())
    if not pool or cap == 0:
        return []
    share = {n: total * w.capacity / cap for n, w in pool.items()}
    queue = {n: list(placed.get(n, ())) for n in pool}
    moves: list[tuple[str, str, str]] = []
    while True:
        over = max(pool.values(), key=lambda w: (w.conversations - share[w.name], w.name))
        under = min((w for w in pool.values() if w.room > 0),
                    key=lambda w: (w.conversations - share[w.name], w.name), default=None)
        if under is None or over.name == under.name or not queue[over.name]:
            return moves
        if over.conversations - share[over.name] < 1 or under.conversations + 1 - share[under.name] >= 1:
            return moves  # within one of its share, or the move would just swap which one is over
        conv = queue[over.name].pop()
        moves.append((conv, over.name, under.name))
        pool[over.name] = replace(over, conversations=over.conversations - 1)
        pool[under.name] = replace(under, conversations=under.conversations + 1)
