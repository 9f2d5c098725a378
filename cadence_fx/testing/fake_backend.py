"""A replay backend for the CPU: "capture" records the callable and its static arguments, "replay"
reruns it and writes the results into the static outputs, as a graph writes its fixed buffers. It
lets the tests drive the replay engine (signatures, staging, admission, fallbacks) without a GPU."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from cadence_fx.runtime.exact_replay import flatten_outputs

__all__ = ["FakeBackend"]


class FakeBackend:
    """CPU stand-in: "capture" records fn and its static args, "replay" reruns fn on them
    and writes the results into the static outputs, as a graph writes its fixed buffers.
    Device randomness is ``self.generator`` (callables must draw from it explicitly)."""

    device_type = "cpu"

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.captures = 0
        self.replays = 0
        self.fail_capture: Exception | None = None  # set to make the next captures raise
        self._lock = threading.RLock()  # re-entrant: a replay inside a replay (a nested fake one) must not deadlock

    def exclusive(self) -> AbstractContextManager[object]:
        """One replay at a time, as :meth:`CudaGraphBackend.exclusive` (on the CPU, host turns are all)."""
        return self._lock

    def available(self) -> bool:
        return True

    def new_pool(self) -> object:
        return object()

    def side_stream(self) -> AbstractContextManager[object]:
        return nullcontext()

    def device_rng_get(self) -> torch.Tensor:
        return self.generator.get_state()

    def draws(self) -> AbstractContextManager[object]:
        return nullcontext()

    def device_rng_set(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def capture(self, fn, static_args, pool):
        if self.fail_capture is not None:
            raise self.fail_capture
        self.captures += 1
        outputs = fn(*static_args)  # the engine restores whatever this run changed
        static, _ = flatten_outputs(outputs)

        def replay() -> None:
            self.replays += 1
            fresh, _ = flatten_outputs(fn(*static_args))
            for s, f in zip(static, fresh):
                if s is not None and f is not None and s.data_ptr() != f.data_ptr():
                    s.copy_(f)

        nbytes = sum(t.untyped_storage().nbytes() for t in static if t is not None)
        return replay, outputs, nbytes
