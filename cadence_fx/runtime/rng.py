"""Per-session random streams over the process-wide default generators.

A step that draws randomness (HiFT's sine source: ``torch.rand``, ``randn_like``) draws from the
default CPU and CUDA generators, which are one per process. Run alone, a conversation's draws
follow one Philox sequence; interleaved with other conversations on the same generators, they would
not. So each session carries its own generator states, and every draw it makes (an eager random op,
or the replay of a graph that draws) runs with the session's states installed in the default
generators, under one process-wide lock, and saves them back. The lock is held only around
launching the draw, not while the device computes: sessions on different streams still overlap.

Outside a session (plain ``prog(...)``), nothing is swapped: draws use the generators as they are.

Captured graphs that draw read the generator's seed and offset from device tensors that belong to the
generator state they were captured under, written by each replay's prologue on the replaying stream.
Each lane's backend therefore captures and replays under a state of its own (:class:`GraphGenerator`,
where torch has graph-safe generator states), loaded with the drawing session's seed and offset before
the launch and read back after it: lanes replaying such graphs at once write different tensors. Where
torch lacks them, :func:`replaying_draws` orders those replays across lanes instead.
"""

from __future__ import annotations

import os
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

try:
    import numpy as _np
except ImportError:  # numpy is optional; its global RNG is then not watched
    _np = None

__all__ = ["LOCKLESS_DRAW_REPLAY", "GraphGenerator", "RngStates", "SessionRng", "active_session_rng", "draw_lock_stats",
           "draw_random", "drawing", "draws_held", "host_rng", "host_rng_equal", "replaying_draws", "set_host_rng",
           "session_rng"]

_lock = threading.RLock()
_local = threading.local()

#: Replays of graphs that draw, inside a session, load the session's CUDA stream into the lane's own
#: generator state directly, without the process-wide lock (``CADENCE_FX_LOCKLESS_DRAW_REPLAY=1``; off
#: by default until measured exact on the GPU). The lane's graphs read only the lane's state, and the
#: lane and the session are each held by one thread, so nothing else reads or writes what they touch.
LOCKLESS_DRAW_REPLAY = os.environ.get("CADENCE_FX_LOCKLESS_DRAW_REPLAY", "") == "1"


class _LockStats:
    """Time threads waited for and held the draws' lock (outermost holds only): the lock is process-wide,
    so a hold that blocks (a launch into a full queue) stalls every lane's draws."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.acquired = 0
        self.wait_s = 0.0
        self.held_s = 0.0
        self.max_held_s = 0.0


_stats = _LockStats()


@contextmanager
def _held() -> Iterator[None]:
    t0 = time.perf_counter()
    with _lock:
        outer = getattr(_local, "depth", 0) == 0
        _local.depth = getattr(_local, "depth", 0) + 1
        t1 = time.perf_counter()
        try:
            yield
        finally:
            _local.depth -= 1
            if outer:
                held = time.perf_counter() - t1
                _stats.acquired += 1
                _stats.wait_s += t1 - t0
                _stats.held_s += held
                _stats.max_held_s = max(_stats.max_held_s, held)


def draw_lock_stats(reset: bool = False) -> dict[str, float]:
    """How often the draws' lock was taken (outermost), the seconds threads waited for it and held it,
    and the longest hold, since the last reset: what a benchmark reports beside its latencies."""
    with _lock:
        out = {"acquired": _stats.acquired, "wait_s": _stats.wait_s, "held_s": _stats.held_s,
               "max_held_ms": _stats.max_held_s * 1e3}
        if reset:
            _stats.reset()
    return out


@dataclass
class RngStates:
    """The default generators' states: CPU, and CUDA per device (None without CUDA)."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def current(cls) -> "RngStates":
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    @classmethod
    def seeded(cls, seed: int) -> "RngStates":
        """The states ``torch.manual_seed(seed)`` gives, without touching the process's generators
        (fresh generators of each device, seeded: the same seed and offset, in the same format)."""
        cpu = torch.Generator().manual_seed(seed).get_state()
        if not torch.cuda.is_available():
            return cls(cpu, None)
        cuda = [torch.Generator(device=f"cuda:{i}").manual_seed(seed).get_state()
                for i in range(torch.cuda.device_count())]
        return cls(cpu, cuda)

    def install(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)

    def clone(self) -> "RngStates":
        return RngStates(self.cpu.clone(), None if self.cuda is None else [t.clone() for t in self.cuda])


class SessionRng:
    """A session's generator states; advanced by every draw made while it is the thread's active one."""

    def __init__(self, states: RngStates) -> None:
        self.states = states


@contextmanager
def session_rng(rng: SessionRng | None) -> Iterator[None]:
    """Make ``rng`` the calling thread's active session streams for the block."""
    prev = getattr(_local, "rng", None)
    _local.rng = rng
    try:
        yield
    finally:
        _local.rng = prev


def active_session_rng() -> "SessionRng | None":
    """The calling thread's active session streams (:func:`session_rng`), or None."""
    return getattr(_local, "rng", None)


@contextmanager
def drawing() -> Iterator[None]:
    """Around a random draw: install the active session's states, then save them back (no-op outside one)."""
    rng: SessionRng | None = getattr(_local, "rng", None)
    if rng is None:
        yield
        return
    with _held():
        outside = RngStates.current()
        rng.states.install()
        try:
            yield
        finally:
            rng.states = RngStates.current()
            outside.install()


@contextmanager
def draws_held() -> Iterator[None]:
    """Hold every draw of the process for the block: no session installs its streams in the default
    generators and no backend swaps its generator state in. A capture beside traffic reads the default
    generators, runs the class eagerly and rewinds them (:meth:`ExactShapeReplay.capture`); a session's
    streams installed meanwhile would be read, advanced and rewound with them."""
    with _held():
        yield


class GraphGenerator:
    """One backend's own state of a device's default CUDA generator, installed around its captures and
    around the replays of its graphs that draw (inside :func:`drawing`).

    While installed, the generator draws from this state; installing copies the generator's seed and
    offset (the session's, inside :func:`drawing`) in, and removing it copies them back out, so every
    draw continues the stream it would have continued with no swap. The graphs captured while it is
    installed write their replay prologue into this state's device tensors only.
    """

    def __init__(self, device: torch.device) -> None:
        self._gen = torch.cuda.default_generators[device.index]  # a backend's device always names its index
        self._index = device.index
        self._state = self._gen.clone_state()

    @contextmanager
    def replaying_for(self, rng: SessionRng) -> Iterator[None]:
        """Around the replay of a graph captured under this state, for session ``rng`` (held by the
        calling thread), without the process-wide lock: the session's stream on this device is loaded
        into this state, and what the replay's prologue advanced it to is the session's afterwards (a
        new states object, as every draw makes). The default generator is not touched."""
        states = rng.states
        if states.cuda is None:
            raise RuntimeError("a session without CUDA generator states replays a CUDA graph that draws")
        self._state.set_state(states.cuda[self._index])
        yield
        cuda = list(states.cuda)
        cuda[self._index] = self._state.get_state()
        rng.states = RngStates(states.cpu, cuda)

    @staticmethod
    def supported() -> bool:
        return torch.cuda.is_available() and hasattr(torch.Generator, "graphsafe_set_state")

    @contextmanager
    def installed(self) -> Iterator[None]:
        with _held():
            outer = self._gen.graphsafe_get_state()
            self._state.set_state(self._gen.get_state())
            self._gen.graphsafe_set_state(self._state)
            try:
                yield
            finally:
                self._gen.graphsafe_set_state(outer)
                self._gen.set_state(self._state.get_state())


_last_replay: Any = None  # the event after the last replayed graph that draws, on whichever stream ran it


@contextmanager
def replaying_draws() -> Iterator[None]:
    """Around launching a captured graph that draws, inside :func:`drawing`, where the backend has no
    :class:`GraphGenerator` (torch without graph-safe generator states).

    A replay writes the generator's seed and offset into device tensors that every captured graph
    of that generator reads (its replay prologue), on the replaying stream. Two lanes replaying such
    graphs on two streams would race on those tensors, so each such replay is ordered after the
    previous one's completion (only the graphs that draw; the rest of each lane runs freely).
    """
    global _last_replay
    rng = getattr(_local, "rng", None)
    if rng is None or not torch.cuda.is_available():
        yield
        return
    stream = torch.cuda.current_stream()
    if _last_replay is not None:
        stream.wait_event(_last_replay)
    try:
        yield
    finally:
        _last_replay = torch.cuda.Event()
        _last_replay.record(stream)


def draw_random(op: Any, *args: Any, **kwargs: Any) -> Any:
    """An eager random op of the step, drawn from the active session's streams (graph-side hook)."""
    with drawing():
        return op(*args, **kwargs)


def host_rng() -> tuple:
    """The host generators a replay must not touch: torch's CPU one, Python's, numpy's global one."""
    return (torch.get_rng_state(), random.getstate(), _np.random.get_state() if _np is not None else None)


def set_host_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    if _np is not None:
        _np.random.set_state(state[2])


def host_rng_equal(a: tuple, b: tuple) -> bool:
    if not torch.equal(a[0], b[0]) or a[1] != b[1]:
        return False
    if _np is None:
        return True
    (na, ka, *ra), (nb, kb, *rb) = a[2], b[2]
    return na == nb and _np.array_equal(ka, kb) and ra == rb
