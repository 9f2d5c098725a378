"""Exact-shape replay: one CUDA graph per exact input signature, eager otherwise.

``ExactShapeReplay`` wraps one callable of tensors and replays it through
graphs captured at exact signatures (no padding, no buckets). Admission fails
closed: whatever the engine cannot prove equal to eager runs eagerly, and every
such call is counted by reason. See the paper, sections 3.3-3.4.

Graph memory per class (``ClassReport.graph_bytes``) is the change of
``torch.cuda.memory_reserved()`` across the capture, i.e. what the graph's
private pool newly took from the device. Classes sharing one pool can reuse
blocks freed by earlier captures, so later classes may report less.
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
import warnings
from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import torch

from cadence_fx.determinism import bits_equal
from cadence_fx.kernel_settings import key as _kernel_key
from cadence_fx.streams import StreamHandoff

if TYPE_CHECKING:
    from cadence_fx.branches import BranchPlan

try:
    import numpy as _np
except ImportError:  # numpy is optional; its global RNG is then not watched
    _np = None

__all__ = [
    "ClassReport", "CudaGraphBackend", "ExactShapeReplay", "FakeBackend",
    "ReplayBackend", "ReplayCounters", "Signature", "StagingArena",
]

log = logging.getLogger("cadence_fx.replay")

Signature = tuple
_SCALARS = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_TENSORS = (torch.Tensor, torch.nn.Parameter)  # other subclasses may override ops: not keyed
_ALIGN = 16  # kernels (vectorized loads, cuBLAS) pick paths by pointer alignment up to 16 bytes
_WARMUP = 2
# Snapshots taken to rewind a capture go to host memory from this size on: a capture must not
# raise the device peak by the size of the state it rewinds (region buffers, workspaces).
_HOST_SNAPSHOT_BYTES = 1 << 20


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
        parallel streams of its graph (:mod:`cadence_fx.branches`); 1 captures every kernel on one stream.
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

    def generator(self) -> Any:
        """The generator state this backend's graphs are captured and replayed under (None where torch
        has no graph-safe generator states: draws are then ordered across backends)."""
        from cadence_fx.runtime.rng import GraphGenerator

        if self._generator is None and GraphGenerator.supported():
            self._generator = GraphGenerator(self.device)
        return self._generator

    def draws(self) -> AbstractContextManager[object]:
        """Around launching the replay of a graph that draws (inside the calling session's
        :func:`~cadence_fx.runtime.rng.drawing`, where there is one)."""
        gen = self.generator()
        return _ordered_draws() if gen is None else gen.installed()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if self._device is None
                            else torch.device("cuda", self._device).index)

    def fork(self) -> "CudaGraphBackend":
        """A backend on the same device with a stream and a graph pool of its own (one per lane of sessions)."""
        return CudaGraphBackend(self._device, branches=self.branches, blas_streams=self.blas_streams)

    def captured_form(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """What warm-up and capture run for ``fn``: ``fn`` itself, or with ``branches`` > 1 and ``fn`` a
        partition whose kernels can run in parallel, a :class:`~cadence_fx.branches.BranchedRun` of it on
        the capture stream and this backend's branch streams (the same streams for every capture, so
        each keeps one cuBLAS workspace, made in warm-up)."""
        from torch.fx import GraphModule

        from cadence_fx.branches import BranchedRun, plan_branches

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
            self._streams[key] = torch.cuda.Stream(dev)
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
        with self._lock, self._handoff.held_on(torch.cuda.current_stream(self.device)):
            yield

    def device_rng_set(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def capture(self, fn, static_args, pool):
        dev = self.device
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
                    torch.cuda.graph(graph, pool=pool, stream=self._stream("capture")):
                outputs = fn(*static_args)
        except BaseException:
            _recover_from_failed_capture(dev, stream)
            self._streams.pop(("capture", dev.index), None)  # a broken capture's stream is not reused
            raise
        torch.cuda.synchronize(dev)
        return graph.replay, outputs, max(0, torch.cuda.memory_reserved(dev) - before)


def _recover_from_failed_capture(dev: torch.device, stream: torch.cuda.Stream) -> None:
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
        with torch.cuda.device(dev), torch.cuda.graph(empty):
            pass
    torch.cuda.set_stream(stream)
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
        static, _ = _flatten(outputs)

        def replay() -> None:
            self.replays += 1
            fresh, _ = _flatten(fn(*static_args))
            for s, f in zip(static, fresh):
                if s is not None and f is not None and s.data_ptr() != f.data_ptr():
                    s.copy_(f)

        nbytes = sum(t.untyped_storage().nbytes() for t in static if t is not None)
        return replay, outputs, nbytes


@dataclass
class ReplayCounters:
    """Per-engine call accounting; every eager call has exactly one rejection reason."""

    replays: int = 0
    eager: int = 0
    rejections: Counter[str] = field(default_factory=Counter)
    invalidations: int = 0
    captures: int = 0


@dataclass
class ClassReport:
    """Outcome of ``capture`` for one signature class."""

    key: Signature | None
    admitted: bool
    reason: str | None = None          # rejection reason when not admitted
    effect: str | None = None          # "pure" | "device_rng"
    capture_seconds: float = 0.0       # probe + warm-up + capture
    # host seconds by phase: "probe" (the eager run that classifies effects, and its rewind),
    # "stage_and_warmup" (static buffers loaded, warm-up runs queued), "capture" (the backend's capture,
    # which waits for the device first: queued warm-up work lands here)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    graph_bytes: int = 0               # memory_reserved delta across capture (see module doc)
    staging_bytes: int = 0             # static input buffers this capture allocated (outside the graph pool;
                                       # 0 when they fit in the engine's shared StagingArena)
    staged_bytes: int = 0              # what each replay copies into static input buffers
    aliased_ptrs: dict[int, int] = field(default_factory=dict)
    copy_back: tuple[int, ...] = ()    # staged arguments fn mutates, written back after replay
    snapshotted: frozenset[int] = frozenset()  # storages of the arguments capture snapshotted to rewind
    error: str | None = None


@dataclass
class _Graph:
    report: ClassReport
    replay: Callable[[], None]
    static_args: list[object]
    stages: tuple[_Stage, ...]
    static_outputs: list[torch.Tensor | None]
    rebuild: Callable[[list], Any]
    keep: tuple[bool, ...]  # outputs viewing an aliased buffer: returned as-is


def _flatten(out: Any) -> tuple[list[torch.Tensor | None], Callable[[list], Any]]:
    if isinstance(out, torch.Tensor):
        return [out], lambda xs: xs[0]
    if type(out) in (tuple, list) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        kind = type(out)
        return list(out), (lambda xs: kind(xs))
    raise TypeError(f"unsupported output type {type(out).__name__}: expected a tensor or a tuple/list of tensors")


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _ordered_draws() -> AbstractContextManager[object]:
    """A backend without a generator state of its own: its replays that draw are ordered across lanes."""
    from cadence_fx.runtime.rng import replaying_draws

    return replaying_draws()


def _host_rng() -> tuple:
    return (torch.get_rng_state(), random.getstate(), _np.random.get_state() if _np is not None else None)


def _host_rng_set(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    if _np is not None:
        _np.random.set_state(state[2])


def _host_rng_equal(a: tuple, b: tuple) -> bool:
    if not torch.equal(a[0], b[0]) or a[1] != b[1]:
        return False
    if _np is None:
        return True
    (na, ka, *ra), (nb, kb, *rb) = a[2], b[2]
    return na == nb and _np.array_equal(ka, kb) and ra == rb


@dataclass
class _Stage:
    """Copies one argument into its static buffer. Arguments with a zero stride
    (expanded) cannot be written elementwise, so their whole storage span is copied."""

    index: int
    dst: torch.Tensor
    span: int | None  # element count of the span to copy, or None for a plain copy_

    def load(self, src: torch.Tensor) -> None:
        if self.span is None:
            self.dst.copy_(src)
        else:
            self.dst.copy_(src.as_strided((self.span,), (1,), src.storage_offset()))


class StagingArena:
    """Device memory that the staged arguments of a set of engines share (the runners of one lane).

    The engines of one lane replay one at a time, in the order of one stream. Every replay loads its
    staged arguments just before it runs, and the outputs that view them are cloned before the next
    engine runs. So their classes can stage into the same bytes: the lane holds the largest class's
    staging, not the sum over every class of every engine. (Without the state rule, a solver's history
    passed to each of ten step graphs was staged once per graph.)

    One class's arguments are packed side by side, never overlapping. A class that needs more than
    the arena holds gets a new, larger arena; the graphs captured on the old one keep it alive, and
    :attr:`allocated` counts both.
    """

    _GRAIN = 64  # bytes between one argument and the next; the pointer alignment inside is the argument's own

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self.allocated = 0

    def place(self, tensors: Sequence[tuple[int, torch.Tensor]]) -> tuple[list[tuple[torch.Tensor, _Stage]], int]:
        """Static buffers for one class's staged arguments ``(position, tensor)``; returns them and the bytes
        this call newly allocated."""
        layout, end = [], {}
        for i, t in tensors:
            extent, shift = _extent(t), (t.data_ptr() % _ALIGN) // t.element_size()
            start = -(-end.get(t.device, 0) // self._GRAIN) * self._GRAIN
            layout.append((i, t, start, extent, shift))
            end[t.device] = start + (extent + shift) * t.element_size()
        grown = 0
        for dev, need in end.items():
            buf = self._buffers.get(dev)
            if buf is None or buf.numel() < need:
                self._buffers[dev] = torch.empty(need, dtype=torch.uint8, device=dev)
                grown += need
        self.allocated += grown
        placed = []
        for i, t, start, extent, shift in layout:
            nbytes = (extent + shift) * t.element_size()
            flat = self._buffers[t.device][start:start + nbytes].view(t.dtype)
            placed.append(_static_view(i, t, flat, extent, shift))
        return placed, grown


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last, through its strides."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _static_view(index: int, t: torch.Tensor, flat: torch.Tensor, extent: int, shift: int
                 ) -> tuple[torch.Tensor, _Stage]:
    static = flat.as_strided(t.shape, t.stride(), flat.storage_offset() + shift)
    if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
        return static, _Stage(index, flat[shift:], extent)
    return static, _Stage(index, static, None)


def _staging_buffer(index: int, t: torch.Tensor) -> tuple[torch.Tensor, _Stage]:
    """A buffer of its own with the shape, strides, dtype, device and pointer alignment of ``t``."""
    extent, shift = _extent(t), (t.data_ptr() % _ALIGN) // t.element_size()
    return _static_view(index, t, torch.empty(extent + shift, dtype=t.dtype, device=t.device), extent, shift)


class ExactShapeReplay:
    """Replays ``fn`` through one graph per exact input signature; eager otherwise.

    ``aliased`` names argument positions holding contract-owned buffers: the
    graph uses them in place (no staging copy) and each call checks their
    ``data_ptr()``. Other tensor arguments are copied into per-class static
    buffers before each replay. Classes are captured only through ``capture``.

    ``mutable``, when given, lists every argument position ``fn`` may write (known from the graph
    when ``fn`` is a partition); capture then snapshots only those. Without it every tensor argument
    not in ``readonly`` is snapshotted and compared. 0-dim CPU tensors (constants a device op reads
    as a scalar) are keyed by value: capture bakes the value, a different value is another class.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str, aliased: Sequence[int] = (),
                 pool: object = None, backend: ReplayBackend | None = None,
                 clone_outputs: bool = True, readonly: Sequence[int] = (),
                 mutable: Sequence[int] | None = None, arena: StagingArena | None = None) -> None:
        self.fn = fn
        self.arena = arena
        self.name = name
        self.aliased = tuple(sorted(set(aliased)))
        self._aliased_set = frozenset(self.aliased)
        self.backend: ReplayBackend = CudaGraphBackend() if backend is None else backend
        # a backend without the method (a user's own) gives no guarantee beyond one caller at a time
        self._exclusive: Callable[[], AbstractContextManager[object]] = getattr(self.backend, "exclusive", nullcontext)
        self._draws: Callable[[], AbstractContextManager[object]] = getattr(self.backend, "draws", _ordered_draws)
        self._live = self.backend.available()
        self.pool = pool
        self.clone_outputs = clone_outputs
        # arguments the caller guarantees fn never writes (weights, constants): the probe need not
        # snapshot them
        self.readonly = frozenset(readonly)
        self.mutable = None if mutable is None else frozenset(mutable)
        self.counters = ReplayCounters()
        self.classes: dict[Signature, ClassReport] = {}
        self._graphs: dict[Signature, _Graph] = {}
        self._refused: dict[Signature, str] = {}  # key -> reason calls with it run eager
        self._logged: set[tuple[str, Signature | None]] = set()
        self._captured_fn: Callable[..., Any] | None = None

    @property
    def branch_plan(self) -> "BranchPlan | None":
        """The parallel-branch plan the captures use (:class:`cadence_fx.branches.BranchPlan`), or ``None``
        (one stream, or nothing captured yet)."""
        return getattr(self._captured_fn, "plan", None)

    # -- keying ---------------------------------------------------------------

    def signature(self, args: Sequence[object]) -> Signature | None:
        """Hashable key of a call, or None if some argument cannot be keyed.

        Reads only metadata (never tensor data, never synchronizes). Beyond shape,
        stride, dtype, device and requires_grad, the key holds pointer alignment
        (kernel choice can depend on it) and the ambient numeric settings that
        change which kernels eager would run (:mod:`cadence_fx.kernel_settings`): after
        a change, calls miss every class captured before it and run eagerly until a
        warm-up captures them under the new settings.
        """
        aliased = self._aliased_set
        if aliased and self.aliased[-1] >= len(args):
            return None
        # runs before every replay, once per argument (a Moshi LM step has a hundred): names are bound
        # locally and the checks inlined, the key is the same
        parts: list[object] = [_ambient()]
        append = parts.append
        storages: dict[int, int] = {}
        strided = torch.strided
        for i, a in enumerate(args):
            if type(a) in _TENSORS:
                if a.layout is not strided or a.is_conj() or a.is_neg() or a.is_quantized:
                    return None
                if a.dim() == 0 and self._host_scalar(a):  # the cheap test first: most arguments are not 0-dim
                    if a.requires_grad:
                        return None
                    append(("host_scalar", a.dtype, bytes(a.reshape(1).view(torch.uint8).tolist())))
                    continue
                # A staged copy would break aliasing with another argument, so refuse it.
                sp = a.untyped_storage().data_ptr()
                if sp:
                    first = storages.setdefault(sp, i)
                    if first != i and (i not in aliased or first not in aliased):
                        return None
                append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad, a.data_ptr() % _ALIGN))
            elif i in aliased:
                return None
            elif type(a) is float:
                append((float, struct.pack("<d", a)))  # exact bits: -0.0 and NaN differ from 0.0
            elif type(a) in _SCALARS:
                append((type(a), a))
            else:
                return None
        return tuple(parts)

    # -- calls ------------------------------------------------------------------

    def __call__(self, *args: object) -> Any:
        if not self._live:
            return self._eager("no_backend", None, args)
        key = self.signature(args)
        if key is None:
            return self._eager("unkeyable_argument", None, args)
        g = self._graphs.get(key)
        if g is None:
            return self._eager(self._refused.get(key, "signature_miss"), key, args)
        for i, ptr in g.report.aliased_ptrs.items():
            if args[i].data_ptr() != ptr:
                self._drop(key, f"aliased argument {i} moved from {ptr:#x} to {args[i].data_ptr():#x}")
                return self._eager("pointer_drift", key, args)
        # a graph that draws replays under its backend's generator state (taken before the backend's
        # turn, in the order the session streams take their lock: see runtime.rng)
        with self._draws() if g.report.effect == "device_rng" else nullcontext(), self._exclusive():
            for stage in g.stages:
                stage.load(args[stage.index])
            g.replay()
            for i in g.report.copy_back:
                args[i].copy_(g.static_args[i])
            outs = [o.clone() if o is not None and self.clone_outputs and not keep else o
                    for o, keep in zip(g.static_outputs, g.keep)]
            self.counters.replays += 1
        return g.rebuild(outs)

    def capture(self, *args: object, restored_by_caller: frozenset[int] = frozenset()) -> ClassReport:
        """Probe, warm up and capture the class of ``args``; state is left as found.

        The probe runs ``fn`` eagerly once to classify its effects; warm-up and
        capture run on static buffers. RNG states are restored after every run; the
        arguments ``fn`` writes (``mutable``, or found by comparison) are restored after
        the probe and once more after the capture, from snapshots kept on the host when large.

        ``restored_by_caller``: storage pointers the caller snapshots and restores itself around
        a whole warm-up (an optimized program's regions and workspaces). Written arguments in
        them are not snapshotted per capture: with one graph per solver step, each capture
        would otherwise copy the whole 600 MiB cache workspace to the host and back.
        """
        if not self._live:
            return self._refuse(None, "no_backend")
        key = self.signature(args)
        if key is None:
            return self._refuse(None, "unkeyable_argument")
        if key in self._graphs:
            return self._graphs[key].report
        if self._refused.get(key) == "host_randomness":
            return ClassReport(key, False, "host_randomness")
        foreign = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                   and a.device.type != self.backend.device_type and not self._host_scalar(a)]
        if foreign:
            return self._refuse(key, "capture_failed", error=f"arguments {foreign} are not on the backend's device")
        written_scalars = [i for i in (self.mutable or ()) if self._host_scalar(args[i])]
        if written_scalars:  # host work is not captured: a write to a host scalar would happen once
            return self._refuse(key, "capture_failed", error=f"host scalar arguments {written_scalars} are written")
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            # Replay would hand back outputs detached from the caller's autograd graph.
            return self._refuse(key, "capture_failed", error="autograd is recording; capture under no_grad")

        start = time.perf_counter()
        # what capture must rewind: the arguments fn writes (known) or may write (not read-only)
        tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                   and (i in self.mutable if self.mutable is not None else i not in self.readonly)}
        # writes found by comparison need every snapshot; declared writes skip what the caller restores
        skip = restored_by_caller if self.mutable is not None else frozenset()
        saved = {i: _snapshot(t) for i, t in tensors.items() if _storage_ptr(t) not in skip}
        versions = {i: _version(t) for i, t in tensors.items()}
        rng = (_host_rng(), self.backend.device_rng_get())
        try:
            # on the capture stream, as the warm-up: a library (cuBLAS) keeps a workspace per stream it
            # ran on, so a probe on the caller's stream would leave one more there that no replay uses
            with self.backend.side_stream():
                probe_out = self.fn(*args)
            host_changed = not _host_rng_equal(rng[0], _host_rng())
            device_changed = not torch.equal(rng[1], self.backend.device_rng_get())
            _flatten(probe_out)
        except Exception as exc:
            self._restore(rng, tensors, saved, saved, versions)
            return self._refuse(key, "capture_failed", error=_describe(exc))
        del probe_out
        mutated = set(tensors) if self.mutable is not None else _mutated(tensors, saved, versions)
        self._restore(rng, tensors, saved, (mutated | set(self.aliased)) & set(saved), versions)
        if host_changed:
            return self._refuse(key, "host_randomness", permanent=True)
        phases = {"probe": time.perf_counter() - start}

        static_args = list(args)
        stages: list[_Stage] = []
        try:
            staged = [(i, t) for i, t in enumerate(args) if isinstance(t, torch.Tensor) and i not in self.aliased]
            if self.arena is not None:
                placed, staging_bytes = self.arena.place(staged)
            else:
                placed = [_staging_buffer(i, t) for i, t in staged]
                staging_bytes = sum(st.untyped_storage().nbytes() for st, _ in placed)
            for (i, t), (static, stage) in zip(staged, placed):
                static_args[i] = static
                stage.load(t)
                stages.append(stage)
            # Staging buffers are reloaded before every replay, so only aliased buffers need restoring;
            # warm-up and capture read whatever the buffers hold (values never change a capture), so
            # they are rewound once, after the capture.
            static_tensors = {i: static_args[i] for i in self.aliased if i in saved}
            if self._captured_fn is None:  # the backend's form of fn (parallel branches), planned once
                self._captured_fn = getattr(self.backend, "captured_form", lambda f: f)(self.fn)
            with self.backend.side_stream():
                for _ in range(_WARMUP):
                    self._captured_fn(*static_args)
                    self._rewind_rng(rng)
            phases["stage_and_warmup"] = time.perf_counter() - start - phases["probe"]
            if self.pool is None:
                self.pool = self.backend.new_pool()
            replay, outputs, graph_bytes = self.backend.capture(self._captured_fn, static_args, self.pool)
            phases["capture"] = time.perf_counter() - start - phases["probe"] - phases["stage_and_warmup"]
            self._restore(rng, static_tensors, saved, static_tensors, versions)
            static_outputs, rebuild = _flatten(outputs)
        except Exception as exc:
            try:
                self._restore(rng, tensors, saved, set(self.aliased) & set(saved), versions)
            except Exception as again:  # a broken capture can leave the stream unusable
                log.error("%s: could not restore state after failed capture: %r", self.name, again)
            return self._refuse(key, "capture_failed", error=_describe(exc))
        snapshotted = frozenset(_storage_ptr(tensors[i]) for i in saved)
        del saved

        staged_at = tuple(st.index for st in stages)
        owned = {_storage_ptr(args[i]) for i in self.aliased} - {0}
        report = ClassReport(
            key, True, effect="device_rng" if device_changed else "pure",
            capture_seconds=time.perf_counter() - start, phase_seconds=phases, graph_bytes=graph_bytes,
            staging_bytes=staging_bytes, staged_bytes=sum(_extent(t) * t.element_size() for _, t in staged),
            aliased_ptrs={i: args[i].data_ptr() for i in self.aliased},
            copy_back=tuple(sorted(i for i in mutated if i in staged_at)),
            snapshotted=snapshotted,
        )
        keep = tuple(o is not None and _storage_ptr(o) in owned for o in static_outputs)
        self._graphs[key] = _Graph(report, replay, static_args, tuple(stages), static_outputs, rebuild, keep)
        self.classes[key] = report
        self._refused.pop(key, None)
        self.counters.captures += 1
        log.info("%s: captured class in %.3fs (%s, %d graph bytes)", self.name,
                 report.capture_seconds, report.effect, graph_bytes)
        return report

    def refusals(self) -> dict[Signature, str]:
        """Signatures whose calls run eagerly, with the reason (capture failed, host randomness, ...)."""
        return dict(self._refused)

    def invalidate(self, key: Signature | None = None) -> None:
        """Drop one captured class (or all); its calls then run eager as ``invalidated``."""
        for k in list(self._graphs) if key is None else [key]:
            if k in self._graphs:
                self._drop(k, "invalidated by caller")

    # -- internals --------------------------------------------------------------

    def _eager(self, reason: str, key: Signature | None, args: Sequence[object]) -> Any:
        self.counters.eager += 1
        self.counters.rejections[reason] += 1
        self._log_once(reason, key, "")
        return self.fn(*args)

    def _refuse(self, key: Signature | None, reason: str, *, permanent: bool = False,
                error: str | None = None) -> ClassReport:
        if key is not None and (permanent or self._refused.get(key) != "host_randomness"):
            self._refused[key] = reason
        self._log_once(reason, key, f" at capture: {error}" if error else " at capture")
        return ClassReport(key, False, reason, error=error)

    def _drop(self, key: Signature, why: str) -> None:
        del self._graphs[key]
        self.classes.pop(key, None)
        self._refused[key] = "invalidated"
        self.counters.invalidations += 1
        log.warning("%s: class invalidated (%s): %s", self.name, why, _short(key))

    def _log_once(self, reason: str, key: Signature | None, detail: str) -> None:
        if (reason, key) not in self._logged:
            self._logged.add((reason, key))
            log.warning("%s: eager (%s)%s: %s", self.name, reason, detail, _short(key))

    def _restore(self, rng: tuple, tensors: dict[int, torch.Tensor], saved: dict[int, torch.Tensor],
                 which: Any, versions: dict[int, int | None]) -> None:
        self._rewind_rng(rng)
        for i in which:
            # untouched since the snapshot (same version counter): copying it back would change nothing
            # but its version, which makes a read-only weight look edited (``WeightsChanged``)
            if versions.get(i) is not None and _version(tensors[i]) == versions[i]:
                continue
            tensors[i].copy_(saved[i])

    def _rewind_rng(self, rng: tuple) -> None:
        _host_rng_set(rng[0])
        self.backend.device_rng_set(rng[1])

    def _host_scalar(self, t: torch.Tensor) -> bool:
        return t.dim() == 0 and t.device.type == "cpu" and self.backend.device_type != "cpu"


def _describe(exc: BaseException) -> str:
    # CUDA capture errors surface at capture_end, masking the call that broke the capture.
    cause = exc.__cause__ or exc.__context__
    return repr(exc) + (f" (while handling {cause!r})" if cause is not None else "")


def _mutated(tensors: dict[int, torch.Tensor], saved: dict[int, torch.Tensor],
             versions: dict[int, int | None]) -> set[int]:
    return {i for i, t in tensors.items()
            if (versions[i] is not None and _version(t) != versions[i])
            or not bits_equal(t.to(saved[i].device), saved[i])}


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy to rewind ``t`` from: on the host when large, so capture does not raise the device peak."""
    if t.device.type != "cpu" and t.untyped_storage().nbytes() >= _HOST_SNAPSHOT_BYTES:
        return t.detach().to("cpu", copy=True)
    return t.detach().clone()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter; fall back to comparing bits
        return None


def _ambient() -> tuple:
    # Settings that change eager's kernels or numerics; a capture is valid only under its own: the call
    # semantics here, every kernel-selection setting from the one table (cadence_fx.kernel_settings)
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            _kernel_key())


def _short(key: Signature | None) -> str:
    if key is None:
        return "<unkeyable>"
    return ", ".join(str(p[0]) if p and isinstance(p[0], tuple) else str(p) for p in key[1:])
