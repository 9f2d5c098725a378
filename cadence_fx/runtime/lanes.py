"""Lanes: one set of rewritten programs, bound to one set of state buffers, replayed on one stream.

CUDA graphs bind addresses, so a lane's graphs read and write that lane's region buffers and
workspaces. A call runs on one lane at a time; lanes run concurrently (each on its own CUDA stream
and graph pool). Sessions do not own graphs: a session's state is copied into a lane's buffers
for a call and out again after it (see :mod:`cadence_fx.runtime.sessions`), so any free lane
serves any session and a joining session captures nothing.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch.fx import Graph, GraphModule

from cadence_fx.annotations import is_journal_attr, is_owned_attr
from cadence_fx.binding import RegionSite
from cadence_fx.analysis.graph_io import fetch_attr
from cadence_fx.analysis.writes import attribute_writes
from cadence_fx.runtime.catalog import Catalog
from cadence_fx.runtime.errors import NoLaneToPin
from cadence_fx.runtime.rng import draw_random
from cadence_fx.runtime.runners import RandomGuard, ReplayRunner, RunnerSet
from cadence_fx.runtime.state import StateStore
from cadence_fx.runtime.streams import StreamHandoff

if TYPE_CHECKING:
    from cadence_fx.passes import ProgramFacts

__all__ = ["LANE_STREAM_PRIORITY", "Entry", "Lane", "LanePool", "lane_writes", "privatize_written_buffers"]

# Lanes' streams come from PyTorch's pool of high-priority streams. Every ``torch.cuda.Stream()`` a
# caller makes is handed out round robin from the default-priority pool (32 streams per device): lane
# streams from that pool would, a few dozen streams later, be handed to a caller's thread as its own
# stream, and that caller's work (its copies of the outputs, and lane 0's calls, which run on the
# caller's stream) would queue behind another session's chunk on that lane.
LANE_STREAM_PRIORITY = -1


@dataclass
class Entry:
    """One exported program of the catalog, rewritten for one lane."""

    gm: GraphModule
    sites: dict[str, RegionSite]
    facts: "ProgramFacts"
    admitted: bool
    draws: bool | None = None  # whether the program draws randomness (worked out at its first call)

    def draws_randomness(self) -> bool:
        """Whether the program draws randomness (a failed call's draws are undone)."""
        if self.draws is None:
            self.draws = any(isinstance(m, RandomGuard) or (isinstance(m, ReplayRunner) and m.random)
                             for m in self.gm.modules()) or \
                any(n.target is draw_random for n in self.gm.graph.nodes if n.op == "call_function")
        return self.draws


@dataclass
class Lane:
    """The programs of one lane, the state they are bound to, their runners and their stream."""

    index: int
    catalog: Catalog[Entry]
    state: StateStore
    runners: RunnerSet
    stream: Any = None  # a torch.cuda.Stream on CUDA; None runs on the caller's current stream
    resident: Any = None  # the session whose state is in this lane's buffers as returned (no copy)
    scratch: list[torch.Tensor] = field(default_factory=list)  # module buffers the graphs write, this lane's copies
    # the catalog classes a warm-up captured here when it left the others out (``warmup(full_lanes=...)``):
    # calls of another class are never handed this lane; None: every class may run here
    classes: frozenset | None = None

    def serves(self, key: Any) -> bool:
        """Whether a call of catalog class ``key`` may run on this lane."""
        return self.classes is None or key in self.classes

    def __post_init__(self) -> None:
        # fixed once the lane is built: checked on every session call's outputs
        self._written = self.state.owned_storages() | {s.untyped_storage().data_ptr() for s in self.scratch}
        self._device = next((t.device for t in self.state.tensors() if t.is_cuda), None)
        self._handoff = StreamHandoff()  # lanes without a stream: from one caller's stream to the next

    def writes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views storage this lane's calls write (regions, workspaces, scratch)."""
        return t.untyped_storage().data_ptr() in self._written

    @contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run the block on the lane's stream, ordered after the caller's stream and before it again.

        A lane without a stream of its own (lane 0) runs each call on its caller's stream. The host
        gives the lane to the next caller as soon as a call returns, while the device may still be
        running it, so a caller on another stream than the previous one first waits, on the device,
        for the previous caller's work on the lane: the same region buffers, workspaces and graphs."""
        if self.stream is None:
            if self._device is None and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                yield  # nothing of the lane's is on a device: the host orders its calls
                return
            with self._handoff.held_on(torch.cuda.current_stream(self._device)):
                yield
            return
        caller = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)


class LanePool:
    """Hands out free lanes; a call that names a lane waits for that one.

    A lane can be held offline (:meth:`hold_offline`: its graphs are still being captured, beside
    traffic): a call that names no lane never gets it until :meth:`bring_online`."""

    def __init__(self, lanes: list[Lane]) -> None:
        self.lanes = lanes
        self._free = threading.Condition()
        self._busy: set[int] = set()
        self._offline: set[int] = set()
        self._pinned: set[int] = set()

    def add(self, lane: Lane) -> None:
        with self._free:
            self.lanes.append(lane)
            self._free.notify_all()

    def hold_offline(self, indices: Iterable[int]) -> None:
        """Hand lanes ``indices`` to no call that names no lane (a warm-up in the background names them)."""
        with self._free:
            self._offline.update(indices)

    def bring_online(self, index: int) -> None:
        with self._free:
            self._offline.discard(index)
            self._free.notify_all()

    def pin(self) -> Lane:
        """Reserve a lane for one session's life (:meth:`unpin` gives it back): the lowest-numbered
        lane after lane 0 that is online and not pinned (:class:`NoLaneToPin` when there is none).
        Calls that name no lane never get a pinned lane; a call running on it now finishes first (the
        pinned session's calls name the lane and wait for it)."""
        with self._free:
            for ln in self.lanes:  # a pinned session's calls all run on its lane: one that has every class
                if ln.index > 0 and ln.index not in self._offline and ln.index not in self._pinned \
                        and ln.classes is None:
                    self._pinned.add(ln.index)
                    return ln
            raise NoLaneToPin(f"no lane to pin: the program has {len(self.lanes)} lane(s) and {len(self._pinned)} "
                              f"are pinned; lane 0 serves the program's own calls and the sessions that are not "
                              f"pinned (optimize(..., lanes=N) for more)")

    def unpin(self, index: int) -> None:
        with self._free:
            self._pinned.discard(index)
            self._free.notify_all()

    def pinned(self) -> int:
        """How many lanes are pinned to sessions."""
        with self._free:
            return len(self._pinned)

    def online(self) -> int:
        """How many lanes calls that name none may get."""
        with self._free:
            return len(self.lanes) - len(self._offline)

    @contextmanager
    def take(self, index: int | None = None, *, prefer_unoccupied: bool = False,
             key: Any = None) -> Iterator[Lane]:
        """A free lane (or lane ``index``), held for the block; waits while none is free.

        ``key``: the call's catalog class; only lanes that serve it (:meth:`Lane.serves`) are candidates.

        ``prefer_unoccupied``: take only lanes no state is resident in (the default session's stays in
        lane 0 between its calls, and the views it returned must keep their bytes), waiting for one
        while all are busy; only a program of one lane evicts the resident state."""
        with self._free:
            while True:
                if index is None:
                    held = self._offline | self._pinned
                    candidates = [ln for ln in self.lanes if ln.index not in held and (key is None or ln.serves(key))]
                else:
                    candidates = [ln for ln in self.lanes if ln.index == index]
                free = [ln for ln in candidates if ln.index not in self._busy]
                if prefer_unoccupied and any(ln.resident is None for ln in candidates):
                    free = [ln for ln in free if ln.resident is None]
                pick = free[0] if free else None
                if pick is not None:
                    self._busy.add(pick.index)
                    break
                self._free.wait()
        try:
            yield pick
        finally:
            with self._free:
                self._busy.discard(pick.index)
                self._free.notify_all()


# attribute_writes per graph of a built lane: lane copies share lane 0's graphs (runtime/clone.py), so
# the walk (a second per lane of Token2Wav's programs) is done once, on the graph as its lane was built
# (before isolate_randomness routes draws through draw_random, which the walk cannot see into)
_WRITES: "weakref.WeakKeyDictionary[Graph, dict[str, bool]]" = weakref.WeakKeyDictionary()
_WRITES_LOCK = threading.Lock()


def lane_writes(mod: GraphModule) -> dict[str, bool]:
    """:func:`~cadence_fx.analysis.writes.attribute_writes` of a lane's program ``mod``, worked out once
    per graph: nothing edits a graph after the passes but the draws' routing (which writes nothing),
    and every lane copy of a program runs lane 0's graph."""
    graph = mod.graph
    with _WRITES_LOCK:
        got = _WRITES.get(graph)
    if got is None:
        got = attribute_writes(mod)
        with _WRITES_LOCK:
            got = _WRITES.setdefault(graph, got)
    return dict(got)


def privatize_written_buffers(gm: GraphModule, copies: dict[int, torch.Tensor], *, clone: bool = True) -> int:
    """Give a lane its own copy of every module buffer its graphs write in place (scratch the stock
    step keeps in its modules, outside the contract's regions and the demand-sized workspaces).

    Two lanes running at once must not write one tensor. ``copies`` maps a stock tensor's id to the
    lane's copy, so every program of the lane shares one copy per buffer. ``clone=False`` only records
    them (lane 0 keeps the stock module's). Returns how many attributes were rebound.
    """
    rebound = 0
    for mod in gm.modules():
        if not isinstance(mod, GraphModule):
            continue
        # written in the module's own graph or, through the input it is passed as, inside a partition
        # it calls (a solver's per-step cache buffer: the root passes it, a partition writes it)
        for target in sorted(lane_writes(mod)):
            if is_owned_attr(target) and not is_journal_attr(target):
                continue
            owner_path, _, leaf = target.rpartition(".")
            owner: Any = fetch_attr(mod, owner_path) if owner_path else mod
            t = getattr(owner, leaf, None)
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) not in copies:
                copies[id(t)] = t.detach().clone() if clone else t
            if t is not copies[id(t)]:
                if leaf in owner._buffers:
                    owner._buffers[leaf] = copies[id(t)]
                else:
                    setattr(owner, leaf, copies[id(t)])
                rebound += 1
    return rebound
