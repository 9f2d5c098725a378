"""Capture backends: what turns a callable into a replayable CUDA graph, and the CPU's stand-in.

:class:`ReplayBackend` is the protocol :class:`~cadence_fx.runtime.exact_replay.ExactShapeReplay`
drives; :class:`CudaGraphBackend` implements it with ``torch.cuda.CUDAGraph`` (one capture stream and
graph pool per device, replays taken in turn, ``branches=N`` parallel streams inside each graph), and
undoes what a capture that failed mid-way leaves behind. The policy (signatures, admission, fallback)
stays in the engine, as torch keeps ``CUDAGraph`` apart from ``make_graphed_callables``.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch.fx import GraphModule

from cadence_fx.analysis.branch_plan import plan_branches
from cadence_fx.runtime.branch_run import BranchedRun
from cadence_fx.runtime import rng as rng_mod
from cadence_fx.runtime.rng import GraphGenerator, active_session_rng, replaying_draws
from cadence_fx.runtime.streams import StreamHandoff, held_stream, stream_lock

__all__ = ["CAPTURE_STREAM_PRIORITIES", "CudaGraphBackend", "ReplayBackend", "beside_traffic",
           "capturing_beside_traffic"]

# the pools capture and branch streams come from, in order: the lower priorities first, which callers'
# own streams (priority 0) and the lanes' (-1) take from least
CAPTURE_STREAM_PRIORITIES = (-3, -2, 0, -1)


class ReplayBackend(Protocol):
    """What the engine needs from a graph backend."""

    device_type: str

    def available(self) -> bool: ...
    def new_pool(self) -> object: ...
    def side_stream(self) -> AbstractContextManager[object]: ...
    def device_rng_get(self) -> torch.Tensor: ...
    def device_rng_set(self, state: torch.Tensor) -> None: ...
    def capture(self, fn: Callable[..., Any], static_args: Sequence[object], pool: object
                ) -> tuple[Callable[[], None], Any, int]: ...


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` backend; the device RNG is the default CUDA generator."""

    device_type = "cuda"

    def __init__(self, device: torch.device | int | None = None, *, branches: int = 1,
                 blas_streams: int | None = None) -> None:
        """``branches`` > 1: a replayed partition's independent chains are captured on up to that many
        parallel streams of its graph (:mod:`cadence_fx.analysis.branch_plan`); 1 captures every kernel on one stream.
        ``blas_streams``: how many of those streams may run matrix products (each stream that does keeps a
        cuBLAS workspace, 32 MiB on Hopper, for the process); default all of them."""
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        if blas_streams is not None and not 1 <= blas_streams <= branches:
            raise ValueError(f"blas_streams must be in 1..branches ({branches}), got {blas_streams}")
        self._device = device
        self.branches = branches
        self.blas_streams = blas_streams
        # One stream per device for every warm-up and capture: cuBLAS keeps a workspace per
        # (handle, stream) for the process's life, so a fresh stream per capture cost one workspace
        # per graph, and a warm-up stream of its own one more per program (docs/design.md, Replay).
        # Warm-up runs eagerly, fenced on both sides, and no graph replays on this stream, so
        # sharing it with the captures is free. (Graphs captured here use this stream's workspace
        # when they replay: the replays of the programs given one backend are serialized by
        # exclusive(); lanes fork a backend of their own.)
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self._pools: dict[int, object] = {}
        # what the graphs of one backend share (the capture stream's cuBLAS workspace, the pool, a lane's
        # staging arena) allows one replay at a time: see exclusive()
        self._lock = threading.RLock()  # re-entrant: a replay inside a replay (a nested fake one) must not deadlock
        self._handoff = StreamHandoff()
        self._generator: Any = None  # this backend's GraphGenerator, made at its first capture
        self._capture_lock: Any = None  # its capture stream's (streams.stream_lock), once it has one

    def generator(self) -> Any:
        """The generator state this backend's graphs are captured and replayed under (None where torch
        has no graph-safe generator states: draws are then ordered across backends)."""
        if self._generator is None and GraphGenerator.supported():
            self._generator = GraphGenerator(self.device)
        return self._generator

    def draws(self) -> AbstractContextManager[object]:
        """Around launching the replay of a graph that draws (inside the calling session's
        :func:`~cadence_fx.runtime.rng.drawing`, where there is one)."""
        gen = self.generator()
        if gen is None:
            return replaying_draws()
        session = active_session_rng() if rng_mod.LOCKLESS_DRAW_REPLAY else None
        return gen.installed() if session is None else gen.replaying_for(session)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if self._device is None
                            else torch.device("cuda", self._device).index)

    def fork(self) -> "CudaGraphBackend":
        """A backend on the same device with a stream and a graph pool of its own (one per lane of sessions)."""
        return CudaGraphBackend(self._device, branches=self.branches, blas_streams=self.blas_streams)

    def captured_form(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """What warm-up and capture run for ``fn``: ``fn`` itself, or with ``branches`` > 1 and ``fn`` a
        partition whose kernels can run in parallel, a :class:`~cadence_fx.runtime.branch_run.BranchedRun` of it on
        the capture stream and this backend's branch streams (the same streams for every capture, so
        each keeps one cuBLAS workspace, made in warm-up)."""
        if self.branches < 2 or not isinstance(fn, GraphModule):
            return fn
        plan = plan_branches(fn, self.branches, blas_streams=self.blas_streams)
        if plan.streams < 2:
            return fn
        streams = [self._stream("capture")] + [self._stream(f"branch{k}") for k in range(1, plan.streams)]
        return BranchedRun(fn, plan, streams)

    def streams(self) -> list[torch.cuda.Stream]:
        """The warm-up and capture streams created so far (one per device, shared by both)."""
        return list(self._streams.values())

    def _stream(self, role: str) -> torch.cuda.Stream:
        dev = self.device
        key = (role, dev.index)
        if key not in self._streams:
            # a stream no other backend captures on: cuBLAS keeps one workspace per stream, baked into the
            # graphs captured there, and two backends' graphs sharing one would race when lanes replay at once
            self._streams[key] = held_stream(dev, CAPTURE_STREAM_PRIORITIES, self)
            if role == "capture":
                self._capture_lock = stream_lock(self._streams[key])
        return self._streams[key]

    def available(self) -> bool:
        return torch.cuda.is_available()

    def new_pool(self) -> object:
        # one pool per backend and device: the programs given one backend replay one at a time (as its
        # one capture stream requires), and every replay's outputs are copied out before the next graph
        # runs, so their graphs can reuse each other's freed blocks as the graphs of one program do
        dev = self.device.index
        if dev not in self._pools:
            self._pools[dev] = torch.cuda.graph_pool_handle()
        return self._pools[dev]

    def side_stream(self) -> AbstractContextManager[object]:
        return _SideStream(self._stream("capture"))

    def device_rng_get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold while one replay loads its inputs, replays and copies its outputs out.

        The graphs of one backend share its capture stream's cuBLAS workspace and its pool (and a lane's
        graphs share a staging arena), so two of their replays must never overlap on the device.
        - Host threads take turns.
        - A replay issued on another stream than the previous one first waits, on the device, for the
          previous one to finish.
        Programs given one backend may therefore be called from several threads and streams: their
        replays are serialized, never interleaved. Lanes fork backends of their own and run in parallel.
        """
        with self._capture_lock or nullcontext(), self._lock, \
                self._handoff.held_on(torch.cuda.current_stream(self.device)):
            yield

    def device_rng_set(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def capture(self, fn, static_args, pool):
        dev = self.device
        beside = capturing_beside_traffic()
        if not beside:
            # Empty the cache first: torch.cuda.graph does so on entry, which would
            # otherwise show up as a negative delta unrelated to the graph.
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(dev)
        gen = self.generator()
        try:
            with gen.installed() if gen is not None else nullcontext(), torch.cuda.device(dev), \
                    _capturing(graph, pool, self._stream("capture"), beside):
                outputs = fn(*static_args)
        except BaseException:
            _recover_from_failed_capture(dev, stream, beside)
            self._streams.pop(("capture", dev.index), None)  # a broken capture's stream is not reused
            raise
        if not beside:
            torch.cuda.synchronize(dev)
        return graph.replay, outputs, max(0, torch.cuda.memory_reserved(dev) - before)


_local = threading.local()


@contextmanager
def beside_traffic() -> Iterator[None]:
    """Captures this thread makes in the block run beside other threads' replays and calls.

    - The capture is in ``thread_local`` mode: other threads' calls a capture forbids in ``global`` mode
      (their allocations, copies to the host, synchronizations) stay legal, and only this thread's are checked.
    - Nothing synchronizes the device or empties the allocator's cache around it: other threads' work is
      in flight and their cached blocks are theirs. The memory a class reports (the reserved memory's
      growth across its capture) then also counts what traffic allocated meanwhile.
    """
    prev = getattr(_local, "beside", False)
    _local.beside = True
    try:
        yield
    finally:
        _local.beside = prev


def capturing_beside_traffic() -> bool:
    """Whether this thread's captures run beside traffic (:func:`beside_traffic`)."""
    return getattr(_local, "beside", False)


@contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream, beside: bool) -> Iterator[None]:
    if not beside:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
        return
    # torch.cuda.graph without its entry's synchronize and empty_cache, in thread_local mode
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def _recover_from_failed_capture(dev: torch.device, stream: torch.cuda.Stream, beside: bool = False) -> None:
    """Undo what a capture that failed mid-way leaves behind.

    When ``capture_end`` raises, ``torch.cuda.graph`` never leaves its stream context (the capture
    stream stays current) and the default CUDA generator never runs its capture epilogue: it stays
    in capture mode and every later eager draw fails with "Offset increment outside graph capture
    encountered unexpectedly". An empty capture runs the prologue/epilogue pair and clears that flag
    without touching the seed or the offset.
    """
    torch.cuda.set_stream(stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        empty = torch.cuda.CUDAGraph()
        # beside traffic, on a stream no other thread uses (a pooled one may be a serving thread's, whose
        # work the capture would then take in)
        own = held_stream(dev, CAPTURE_STREAM_PRIORITIES, empty) if beside else None
        with torch.cuda.device(dev), _capturing(empty, None, own, True) if own is not None else torch.cuda.graph(empty):
            pass
    torch.cuda.set_stream(stream)
    if beside:
        stream.synchronize()
    else:
        torch.cuda.synchronize(dev)


class _SideStream:
    """Warm-up stream, fenced on both sides as the CUDA-graph docs recommend."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._ctx = torch.cuda.stream(self._stream)

    def __enter__(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
