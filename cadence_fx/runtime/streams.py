"""Handing one piece of device memory from stream to stream: each user waits, on the device, for the last.

A resource the host hands out one holder at a time (a backend's graphs, which share a pool and a
cuBLAS workspace; a lane without a stream of its own) is free on the host as soon as the holder's
call returns, while the device may still be running that call's work. A holder on another stream
than the previous one therefore first waits for an event the previous one recorded at its end; a
holder on the same stream is ordered by the stream itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["StreamHandoff"]


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
