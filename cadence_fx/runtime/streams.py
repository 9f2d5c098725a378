"""Handing one piece of device memory from stream to stream: each user waits, on the device, for the last.

A resource the host hands out one holder at a time (a backend's graphs, which share a pool and a
cuBLAS workspace; a lane without a stream of its own) is free on the host as soon as the holder's
call returns, while the device may still be running that call's work. A holder on another stream
than the previous one therefore first waits for an event the previous one recorded at its end; a
holder on the same stream is ordered by the stream itself.
"""

from __future__ import annotations

import logging
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["StreamHandoff", "held_stream", "shared", "stream_lock"]


class StreamHandoff:
    """The last holder's stream and the event after its work. Callers hold the resource (a lock, a lane
    taken from a pool) around :meth:`held_on`; this class orders the device, not the host."""

    def __init__(self) -> None:
        self._events: dict[torch.cuda.Stream, torch.cuda.Event] = {}  # one per stream, recorded again each time
        self._last: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None

    @contextmanager
    def held_on(self, stream: torch.cuda.Stream) -> Iterator[None]:
        """Work launched in the block on ``stream`` runs after the previous holder's (on any stream)."""
        if self._last is not None and self._last[0] != stream:
            stream.wait_event(self._last[1])
        try:
            yield
        finally:
            event = self._events.get(stream)
            if event is None:
                event = self._events[stream] = torch.cuda.Event()
            event.record(stream)  # a wait already issued keeps the record it saw
            self._last = (stream, event)


# Streams a backend or a lane holds for its life, by (device, CUDA stream handle): PyTorch hands out
# ``torch.cuda.Stream()`` round robin from pools of 32 per priority and device, so the 33rd stream of a
# priority is the first again. Two backends capturing on one stream share what a library keys by
# stream: cuBLAS and cuBLASLt keep one workspace per (handle, stream), baked into every graph captured
# there, and two lanes replaying such graphs at once race on it (Moshi's three programs x 16 lanes
# made 48 capture streams: decode lane k shared encode lane k's workspace, and concurrent sessions'
# PCM differed).
_HELD: dict[tuple[int, int], int] = {}
_LOCKS: dict[tuple[int, int], "threading.RLock"] = {}  # one per held stream: its holders' replays
_REGISTRY_LOCK = threading.Lock()
_POOL_SIZE = 32  # torch's streams per priority and device (c10/cuda/CUDAStream.cpp: kStreamsPerPool)
log = logging.getLogger(__name__)


def held_stream(device: torch.device, priorities: tuple[int, ...], owner: object) -> torch.cuda.Stream:
    """A stream from PyTorch's pools that no other holder has, tried in the order of ``priorities``, held
    until ``owner`` is garbage collected. When every pooled stream of those priorities is held, the least
    held one is shared (logged). Every holder of a stream replays under its :func:`stream_lock`
    (uncontended unless the stream is shared)."""
    with _REGISTRY_LOCK:
        seen: dict[tuple[int, int], torch.cuda.Stream] = {}
        for priority in priorities:
            for _ in range(_POOL_SIZE):
                try:
                    s = torch.cuda.Stream(device, priority=priority)
                except RuntimeError:  # a priority this build or device does not have
                    break
                key = (device.index, s.cuda_stream)
                if key in seen:
                    break  # this priority's pool went round (or is clamped to one already tried)
                seen[key] = s
                if not _HELD.get(key):
                    return _hold(key, s, owner)
        key = min(seen, key=lambda k: _HELD.get(k, 0))
        log.warning("every pooled CUDA stream of priorities %s on device %s is held: one is shared (its holders' "
                    "replays are serialized, since libraries keep one workspace per stream)", priorities, device)
        return _hold(key, seen[key], owner)


def stream_lock(stream: torch.cuda.Stream) -> "threading.RLock":
    """The lock every holder of held ``stream`` replays under: the graphs captured on one stream share a
    library workspace, so two holders of a shared stream must not replay at once."""
    with _REGISTRY_LOCK:
        return _LOCKS.setdefault((stream.device.index, stream.cuda_stream), threading.RLock())


def shared(stream: torch.cuda.Stream) -> bool:
    """Whether more than one owner holds ``stream``."""
    with _REGISTRY_LOCK:
        return _HELD.get((stream.device.index, stream.cuda_stream), 0) > 1


def _hold(key: tuple[int, int], stream: torch.cuda.Stream, owner: object) -> torch.cuda.Stream:
    _HELD[key] = _HELD.get(key, 0) + 1
    _LOCKS.setdefault(key, threading.RLock())
    weakref.finalize(owner, _release, key)
    return stream


def _release(key: tuple[int, int]) -> None:
    with _REGISTRY_LOCK:
        n = _HELD.get(key, 0) - 1
        if n > 0:
            _HELD[key] = n
        else:
            _HELD.pop(key, None)
            _LOCKS.pop(key, None)
