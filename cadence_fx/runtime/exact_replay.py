"""Exact-shape replay: one CUDA graph per exact input signature, eager otherwise.

``ExactShapeReplay`` wraps one callable of tensors and replays it through graphs captured at exact
signatures (no padding, no buckets). Admission fails closed: whatever the engine cannot prove equal
to eager runs eagerly, and every such call is counted by reason. See the paper, sections 3.3-3.4.
The capture primitive is a backend's (:mod:`cadence_fx.runtime.backends`); the staging buffers of
one lane are :mod:`cadence_fx.runtime.staging`'s.

Graph memory per class (``ClassReport.graph_bytes``) is the change of ``torch.cuda.memory_reserved()``
across the capture, i.e. what the graph's private pool newly took from the device. Classes sharing
one pool can reuse blocks freed by earlier captures, so later classes may report less.

Why one module: keying a call, capturing its class and replaying it are one engine over one private
table (the captured graphs, the refusals, the staged buffers and the counters); the parts that stand
alone (the backends, staging, the reports, host RNG) already live beside it.
"""

from __future__ import annotations

import logging
import struct
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cadence_fx.analysis.branch_plan import BranchPlan
from cadence_fx.determinism import bits_equal
from cadence_fx import kernel_settings
from cadence_fx.kernel_settings import key as _kernel_key
from cadence_fx.runtime.backends import CudaGraphBackend, ReplayBackend
from cadence_fx.runtime.output_views import OutputPlan, hand_out, held_storages, plan_outputs
from cadence_fx.runtime.output_views import storage_ptr as _storage_ptr
from cadence_fx.runtime.replay_reports import ClassReport, ReplayCounters, Signature
from cadence_fx.runtime.rng import host_rng, host_rng_equal, replaying_draws, set_host_rng
from cadence_fx.runtime.staging import ALIGN, Stage, StagingArena, span_of, staging_buffer

__all__ = ["ExactShapeReplay", "ProbeVerdict", "flatten_outputs"]

log = logging.getLogger("cadence_fx.replay")

_SCALARS = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_TENSORS = (torch.Tensor, torch.nn.Parameter)  # other subclasses may override ops: not keyed
_WARMUP = 2
# rewind snapshots go to the host from this size on: a capture must not raise the device peak by the state
_HOST_SNAPSHOT_BYTES = 1 << 20


@dataclass(frozen=True)
class ProbeVerdict:
    """What probing a class found, for the same partition's engines on other lanes: whether it draws
    from the device generator, and which argument positions it writes."""

    device_changed: bool
    mutated: frozenset[int]


@dataclass
class _Graph:
    report: ClassReport
    replay: Callable[[], None]
    static_args: list[object]
    stages: tuple[Stage, ...]
    static_outputs: list[torch.Tensor | None]
    rebuild: Callable[[list], Any]
    outputs: tuple[OutputPlan, ...]  # how each output is handed back (runtime.output_views)


def flatten_outputs(out: Any) -> tuple[list[torch.Tensor | None], Callable[[list], Any]]:
    if isinstance(out, torch.Tensor):
        return [out], lambda xs: xs[0]
    if type(out) in (tuple, list) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        kind = type(out)
        return list(out), (lambda xs: kind(xs))
    raise TypeError(f"unsupported output type {type(out).__name__}: expected a tensor or a tuple/list of tensors")


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
                 mutable: Sequence[int] | None = None, arena: StagingArena | None = None,
                 verdicts: dict[Signature, ProbeVerdict] | None = None) -> None:
        self.fn = fn
        # the probe's findings per class, shared by this partition's engines on every lane: a lane
        # after the first captures a class a sibling has probed without probing it again
        self.verdicts = verdicts
        self._stream_warm = False  # a run of fn on this backend's capture stream has happened
        self.arena = arena
        self.name = name
        self.draws: str | None = None  # why its graph draws, set by the runner that owns it (None: it does not)
        self.aliased = tuple(sorted(set(aliased)))
        self._aliased_set = frozenset(self.aliased)
        self.backend: ReplayBackend = CudaGraphBackend() if backend is None else backend
        # a backend without the method (a user's own) gives no guarantee beyond one caller at a time
        self._exclusive: Callable[[], AbstractContextManager[object]] = getattr(self.backend, "exclusive", nullcontext)
        self._draws: Callable[[], AbstractContextManager[object]] = getattr(self.backend, "draws", replaying_draws)
        # around an eager fallback: what the caller needs an eager run to draw under, when it did not
        # already install it around the whole call (a drawing partition whose replays skip the lock)
        self.eager_context: Callable[[], AbstractContextManager[object]] = nullcontext
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
        """The parallel-branch plan the captures use (:class:`cadence_fx.analysis.branch_plan.BranchPlan`), or ``None``
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
                append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad, a.data_ptr() % ALIGN))
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
            outs = hand_out(g.static_outputs, g.outputs, args, self.clone_outputs)
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
        if getattr(self.backend, "device_type", None) == "cuda":  # the key as every later call computes it
            kernel_settings.settle(self.backend.device)
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
        versions = {i: _version(t) for i, t in tensors.items()}
        rng = (host_rng(), self.backend.device_rng_get())
        sibling = self.verdicts.get(key) if self.verdicts is not None else None
        if sibling is not None:
            # Another lane's engine of this partition probed this class: the same function on buffers
            # of the same shapes, so the same effects. What is left per lane is the capture itself,
            # after one eager run on this backend's capture stream if none ran there yet (a library
            # keeps a workspace per stream, made at its first use: outside the capture, not inside).
            # With no eager run nothing needs a snapshot: a capture records kernels and runs none.
            # Should it fail anyway, the class is probed and captured the full way below.
            warm_runs = 0 if self._stream_warm else 1
            saved = {i: _snapshot(t) for i, t in tensors.items() if _storage_ptr(t) not in restored_by_caller} \
                if warm_runs else {}
            report = self._capture(key, args, tensors, saved, versions, rng, start, {"probe": 0.0},
                                   sibling.device_changed, set(sibling.mutated), warm_runs)
            if report.admitted:
                return report
            self._refused.pop(key, None)
            start = time.perf_counter()
        # writes found by comparison need every snapshot; declared writes skip what the caller restores
        skip = restored_by_caller if self.mutable is not None else frozenset()
        saved = {i: _snapshot(t) for i, t in tensors.items() if _storage_ptr(t) not in skip}
        try:
            # on the capture stream, as the warm-up: a library (cuBLAS) keeps a workspace per stream it
            # ran on, so a probe on the caller's stream would leave one more there that no replay uses
            with self.backend.side_stream():
                probe_out = self.fn(*args)
            host_changed = not host_rng_equal(rng[0], host_rng())
            device_changed = not torch.equal(rng[1], self.backend.device_rng_get())
            flatten_outputs(probe_out)
        except Exception as exc:
            self._restore(rng, tensors, saved, saved, versions)
            return self._refuse(key, "capture_failed", error=_describe(exc))
        del probe_out
        mutated = set(tensors) if self.mutable is not None else _mutated(tensors, saved, versions)
        self._restore(rng, tensors, saved, (mutated | set(self.aliased)) & set(saved), versions)
        if host_changed:
            return self._refuse(key, "host_randomness", permanent=True)
        return self._capture(key, args, tensors, saved, versions, rng, start,
                             {"probe": time.perf_counter() - start}, device_changed, mutated, _WARMUP)

    def _capture(self, key: Signature, args: Sequence[object], tensors: dict[int, torch.Tensor],
                 saved: dict[int, Any], versions: dict[int, int], rng: Any, start: float,
                 phases: dict[str, float], device_changed: bool, mutated: set[int], warm_runs: int) -> ClassReport:
        """Stage, warm up (``warm_runs`` eager runs) and capture one probed class."""
        static_args = list(args)
        stages: list[Stage] = []
        try:
            staged = [(i, t) for i, t in enumerate(args) if isinstance(t, torch.Tensor) and i not in self.aliased]
            if self.arena is not None:
                placed, staging_bytes = self.arena.place(staged)
            else:
                placed = [staging_buffer(i, t) for i, t in staged]
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
                for _ in range(warm_runs):
                    self._captured_fn(*static_args)
                    self._rewind_rng(rng)
            self._stream_warm = self._stream_warm or warm_runs > 0
            phases["stage_and_warmup"] = time.perf_counter() - start - phases["probe"]
            if self.pool is None:
                self.pool = self.backend.new_pool()
            replay, outputs, graph_bytes = self.backend.capture(self._captured_fn, static_args, self.pool)
            phases["capture"] = time.perf_counter() - start - phases["probe"] - phases["stage_and_warmup"]
            self._restore(rng, static_tensors, saved, static_tensors, versions)
            static_outputs, rebuild = flatten_outputs(outputs)
            # outputs that view memory outliving the replay are handed back as the eager run's views
            in_place = {_storage_ptr(args[i]) for i in self.aliased} - {0}
            persistent = held_storages(self.fn) | in_place
            plans = plan_outputs(static_outputs, static_args, [i for i, _ in staged], persistent)
        except Exception as exc:
            try:
                self._restore(rng, tensors, saved, set(self.aliased) & set(saved), versions)
            except Exception as again:  # a broken capture can leave the stream unusable
                log.error("%s: could not restore state after failed capture: %r", self.name, again)
            return self._refuse(key, "capture_failed", error=_describe(exc))
        snapshotted = frozenset(_storage_ptr(tensors[i]) for i in saved)
        del saved

        staged_at = tuple(st.index for st in stages)
        report = ClassReport(
            key, True, effect="device_rng" if device_changed else "pure",
            capture_seconds=time.perf_counter() - start, phase_seconds=phases, graph_bytes=graph_bytes,
            staging_bytes=staging_bytes, staged_bytes=sum(span_of(t) * t.element_size() for _, t in staged),
            aliased_ptrs={i: args[i].data_ptr() for i in self.aliased},
            copy_back=tuple(sorted(i for i in mutated if i in staged_at)),
            snapshotted=snapshotted,
        )
        self._graphs[key] = _Graph(report, replay, static_args, tuple(stages), static_outputs, rebuild, plans)
        if self.verdicts is not None:
            self.verdicts.setdefault(key, ProbeVerdict(device_changed, frozenset(mutated)))
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
        with self.eager_context():
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
        set_host_rng(rng[0])
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
