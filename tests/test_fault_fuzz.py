"""A fault fuzz: calls, snapshots and restores that raise leave every conversation exact.

A call of the default program or of a session that raises (any exception, ``KeyboardInterrupt``
included), and a restore that raises, leave every region, every random stream and the state the
last call returned exactly as before: the retry, fed that state, gives exactly the bytes of the
conversation run alone through the unmodified programs (:mod:`cadence_fx.runtime.transaction`).

The property draws a small generated streaming step (:mod:`tests.streaming_models`, in a third of the
draws with a draw of randomness every call), exported once under its true contract, and two
programs of it, each with a replay backend drawn (``FakeBackend``, warmed up, or off): one lane
(1 to 3 sessions, each call taking the lane from the one before) and two lanes (1 to 3 sessions on
the second, the default program as one more conversation on the first). Each conversation has its
own prompt state, inputs and seed; their calls are interleaved in a drawn order, and before one to
three calls of each conversation comes a fault, then the call again (the retry):

- an exception at the k-th aten op of a call (a ``TorchDispatchMode``), an ``Exception`` subclass,
  ``torch.OutOfMemoryError`` or ``KeyboardInterrupt``; k is drawn within the ops of that call's
  class, counted once per program with a counting mode (the copy-in or the undo log, the graph,
  the replay's copies, the commit), anywhere, in the last tenth (the state writes) or at the last op;
- a bad input (a state of float64, of another shape or rank, not a tensor, an input of float64, one
  argument too many, an unknown keyword, the state views an older call returned), refused with the
  class the library raises for it;
- a snapshot (a faulted one first, in some draws), and a restore before a later call (a faulted
  restore or one of a bad snapshot first, in some draws; only the failed one, in others). The
  default program's snapshot is a clone of its state and of the process's generator, fed back.

After every step every conversation's held state and random streams are as before a failure, and
each good call's every output equals (``torch.equal``, dtype and shape) that conversation's solo run
at the same step (after a restore, the solo run from the snapshot's step); at the end each
conversation's whole stream has the solo stream's SHA-256. The generated contracts have no dead
capacity (no ``Region.live``), so state outputs are compared whole.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import event as _event
from hypothesis import note as _note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from torch.utils._python_dispatch import TorchDispatchMode

import cadence_fx as cf
from cadence_fx.determinism import sha256_tensors
from cadence_fx.testing.fake_backend import FakeBackend
from cadence_fx.runtime.errors import StateMismatch  # not exported as cf.StateMismatch
from tests.streaming_models import (LAYOUTS, ModelSpec, RegionSpec, StreamStep, example_args, export_catalog,
                                    true_contract)

# ------------------------------------------------------------------------------------------- faults


def event(what: str) -> None:
    if currently_in_test_context():  # the deterministic tests share the harness
        _event(what)


def note(what: str) -> None:
    if currently_in_test_context():
        _note(what)


class InjectedFault(Exception):
    """The failure a :class:`FaultAt` raises (an out-of-range index, a driver error)."""


EXCEPTIONS: dict[str, Callable[[str], BaseException]] = {
    "fault": InjectedFault,
    "oom": lambda msg: torch.OutOfMemoryError(f"CUDA out of memory (injected): {msg}"),
    "interrupt": KeyboardInterrupt,
}


class CountOps(TorchDispatchMode):
    """Counts the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class FaultAt(TorchDispatchMode):
    """Raises an exception of ``kind`` (:data:`EXCEPTIONS`) instead of running the k-th aten op (0-based)
    under it; every other op runs. ``of``: how many ops the call was counted at (for the report)."""

    def __init__(self, k: int, kind: str = "fault", of: int | None = None) -> None:
        super().__init__()
        self.k, self.kind, self.of, self.n = k, kind, of, 0
        self.raised: BaseException | None = None
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i, self.n = self.n, self.n + 1
        if i == self.k and self.raised is None:
            self.op = func
            self.raised = EXCEPTIONS[self.kind](f"injected at op {i} ({func})")
            raise self.raised
        return func(*args, **(kwargs or {}))

    @property
    def fired(self) -> bool:
        return self.raised is not None


def _attempt(fn: Callable[[], Any], mode: TorchDispatchMode | None = None) -> tuple[Any, BaseException | None]:
    """``fn()`` under ``mode``: (its result, None) or (None, what it raised, KeyboardInterrupt included)."""
    try:
        if mode is None:
            return fn(), None
        with mode:
            return fn(), None
    except BaseException as e:  # noqa: BLE001 - the injected KeyboardInterrupt is a result here
        return None, e


# What the library raises for each bad call input, before the graph runs. The catalog keys a call by
# every tensor's shape and dtype and every other argument's type, so a state of another dtype, shape or
# rank, or no tensor at all, is a CatalogMiss: StateMismatch is what a snapshot of the wrong dtype or
# shape gets (below), which is not looked up in the catalog.
BAD_CALLS: dict[str, type[BaseException]] = {
    "state_float64": cf.CatalogMiss,
    "state_shape": cf.CatalogMiss,  # a dim other than the clock axis one longer
    "state_rank": cf.CatalogMiss,
    "state_none": cf.CatalogMiss,
    "state_list": cf.CatalogMiss,
    "x_float64": cf.CatalogMiss,
    "extra_arg": cf.CatalogMiss,
    "kwarg": TypeError,
    "stale": cf.StaleState,  # every state input a view an older call returned
}

BAD_SNAPSHOTS: dict[str, type[BaseException]] = {
    "float64": StateMismatch,
    "shape": StateMismatch,
    "rank": StateMismatch,
    "unknown_region": StateMismatch,
    "not_a_tensor": StateMismatch,
    "not_a_snapshot": TypeError,
}

# ------------------------------------------------------------------------------------------- models


class NoisyStep(StreamStep):
    """The generated step plus one draw of randomness per call (a vocoder's noise source)."""

    def forward(self, *args):
        outs = list(super().forward(*args))
        j = self.spec.out_pos(0)
        outs[j] = outs[j] + 0.1 * torch.randn_like(outs[j])
        return tuple(outs)


@st.composite
def small_regions(draw, chunk: int) -> RegionSpec:
    """A region of :func:`tests.test_contract_properties.region_specs`, smaller (a catalog of a few programs)."""
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    syms, _axis = LAYOUTS[layout]
    size = {"B": draw(st.sampled_from([1, 1, 2])), "H": draw(st.integers(1, 2)), "C": draw(st.integers(1, 3))}
    dims = tuple(size[s] for s in syms)
    order = draw(st.sampled_from(["old_new", "new_old"]))
    grow = draw(st.sampled_from([1, 1, 2]))
    trim = draw(st.sampled_from(["narrow", "slice", "neg"]))
    reads = draw(st.sampled_from(["full", "full", "kept"]))
    if draw(st.integers(0, 2)) == 0:  # a conv carry
        k = draw(st.integers(1, 3))
        if draw(st.booleans()):
            policy, keep = ("ring", k), draw(st.sampled_from(["last", "first"]))
        else:
            policy, keep = ("window", k), "last"
        return RegionSpec("carry", layout, dims, order, policy, initial=k, grow=grow, keep=keep, trim=trim,
                          readout=draw(st.sampled_from(["conv", "conv", "attn", "sum"])), reads=reads)
    if draw(st.booleans()):
        head = draw(st.integers(0, 2))
        policy = ("headtail", head, draw(st.integers(0 if head else 1, 2)))
        bound = policy[1] + policy[2]
    else:
        policy = ("window", draw(st.integers(1, 3)))
        bound = policy[1]
    initial = draw(st.integers(0, bound + grow * chunk)) if draw(st.booleans()) else 0
    return RegionSpec("kv", layout, dims, order, policy, initial=initial, grow=grow, trim=trim,
                      readout=draw(st.sampled_from(["attn", "sum"])), reads=reads)


@st.composite
def small_models(draw) -> ModelSpec:
    chunk = draw(st.integers(1, 2))
    regions = (draw(small_regions(chunk)),)
    if draw(st.booleans()):
        regions += (draw(small_regions(chunk)),)
    aux = draw(st.sampled_from(["none", "none", "last", "state", "dup", "input", "mean"]))
    n_in, n_out = 1 + len(regions), 1 + len(regions) + (aux != "none")
    wrap = draw(st.sampled_from([(), ("blocks.0",), ("out",), ("inp", "out")]
                                + ([("blocks.1",), ("blocks.0", "blocks.1")] if len(regions) == 2 else [])))
    return ModelSpec(dim=draw(st.integers(2, 3)), chunk=chunk, regions=regions, aux=aux,
                     in_perm=tuple(draw(st.permutations(range(n_in)))),
                     out_perm=tuple(draw(st.permutations(range(n_out)))), wrap=wrap,
                     growth_clock=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


_BUILT: dict = {}


def build(spec: ModelSpec, noise: bool):
    """(contract, exported catalog) of a generated step, exported once (the last one is kept)."""
    key = (spec, noise)
    if key not in _BUILT:
        contract = true_contract(spec)
        step = (NoisyStep if noise else StreamStep)(spec).eval()
        _BUILT.clear()
        _BUILT[key] = (contract, export_catalog(step, contract))
    return _BUILT[key]


# ------------------------------------------------------------------------------------- conversations


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _x(spec: ModelSpec, seed: int, k: int) -> torch.Tensor:
    return torch.randn(spec.chunk, spec.dim, generator=torch.Generator().manual_seed(seed * 1009 + k))


def _prompt(spec: ModelSpec, seed: int) -> list[torch.Tensor]:
    """A conversation's own prompt state (each region at its initial extent), by region."""
    extents = {f"r{i}": r.initial for i, r in enumerate(spec.regions)}
    args = example_args(spec, extents, seed=seed)
    return [args[spec.in_pos(1 + i)] for i in range(len(spec.regions))]


def _args(spec: ModelSpec, x: torch.Tensor, state: list) -> list:
    a: list = [None] * spec.n_in
    a[spec.in_pos(0)] = x
    for i, t in enumerate(state):
        a[spec.in_pos(1 + i)] = t
    return a


def _states(spec: ModelSpec, outs: list) -> list:
    return [outs[spec.out_pos(1 + i)] for i in range(len(spec.regions))]


class Solo:
    """The conversation alone through the unmodified programs, no faults: every call's outputs,
    computed as far as asked. Its draws come from a generator state of its own, seeded as a session
    of this seed is (and as the default program is, by ``torch.manual_seed``), installed around each
    of its calls only: the process's generator is left as it finds it."""

    def __init__(self, spec: ModelSpec, ref, seed: int) -> None:
        self.spec, self.ref, self.seed = spec, ref, seed
        self.state = [t.clone() for t in _prompt(spec, seed)]
        self.rng = torch.Generator().manual_seed(seed).get_state()
        self.outs: list[list[torch.Tensor]] = []

    def __getitem__(self, k: int) -> list[torch.Tensor]:
        while len(self.outs) <= k:
            outside = torch.get_rng_state()
            torch.set_rng_state(self.rng)
            try:
                o = [t.clone() for t in _as_list(self.ref(*_args(self.spec, _x(self.spec, self.seed, len(self.outs)),
                                                                 self.state)))]
                self.rng = torch.get_rng_state()
            finally:
                torch.set_rng_state(outside)
            self.outs.append(o)
            self.state = _states(self.spec, o)
        return self.outs[k]


@dataclass
class Conv:
    """One conversation: a session, or the default program (``session`` None)."""

    name: str
    call: Callable
    session: cf.Session | None
    seed: int
    held: list  # the state the next call is fed, by region
    solo: Solo
    step: int = 0
    views: list | None = None  # the state views the library returned last (a call, a restore)
    stale: list | None = None  # the ones returned before those: refused
    snap: tuple | None = None
    got: list = field(default_factory=list)
    want: list = field(default_factory=list)

    def rng(self) -> torch.Tensor:
        return (self.session.rng.states.cpu if self.session is not None else torch.get_rng_state()).clone()


class Harness:
    """One program, its conversations, and the checks after every step."""

    def __init__(self, spec: ModelSpec, prog: cf.OptimizedProgram, ref, lanes: int) -> None:
        self.spec, self.prog, self.ref, self.lanes = spec, prog, ref, lanes
        self.convs: list[Conv] = []
        self.ops: dict = {}  # op counts: by kind ("session", "default": the most; "snapshot", "restore"), by key()
        self.names = [f"r{i}" for i in range(len(spec.regions))]

    # -------------------------------------------------------------- set-up
    def calibrate(self, default: bool) -> None:
        """Count the aten ops of a call of each class a stream reaches (on a throwaway session; on the
        default program fed back the state it returned, and fed copies), of a snapshot and a restore."""
        spec, prompt = self.spec, _prompt(self.spec, 99)
        calls = len(self.prog.catalog) + 2  # past the last class a stream from the prompt reaches

        def stream(kind: str, fn: Callable, copies: bool) -> None:
            state = prompt
            for k in range(calls):
                args = _args(spec, _x(spec, 99, k), state)
                with CountOps() as c:
                    out = _as_list(fn(*args))
                self.ops[self.key(kind, args, in_place=k > 0 and not copies)] = c.n
                self.ops[kind] = max(self.ops.get(kind, 0), c.n)
                state = [t.clone() for t in _states(spec, out)] if copies else _states(spec, out)

        with self.prog.session("calibrate", seed=0) as s:
            stream("session", s, False)
            with CountOps() as c:
                snap = s.snapshot()
            self.ops["snapshot"] = c.n
            s.restore(snap)  # the first restore keeps its views' geometry on the sites: count a later one
            with CountOps() as c:
                s.restore(snap)
            self.ops["restore"] = c.n
        if default:
            stream("default", self.prog, False)
            stream("default", self.prog, True)

    def key(self, kind: str, args: list, *, in_place: bool) -> tuple:
        """What a call's op count depends on: session or default, its class, and for the default
        program whether its state is the one it returned (the undo log) or a copy (copied in)."""
        return (kind, tuple(tuple(a.shape) for a in args), in_place and kind == "default")

    def op_count(self, c: Conv, args: list) -> int:
        """The ops of ``c``'s call on ``args`` (of its class, as counted; else the most of its kind)."""
        kind = "session" if c.session is not None else "default"
        in_place = c.views is not None and all(a is b for a, b in zip(c.held, c.views))
        return self.ops.get(self.key(kind, args, in_place=in_place), self.ops[kind])

    def add(self, conv: Conv) -> None:
        self.convs.append(conv)

    # -------------------------------------------------------------- checks
    def before(self) -> dict:
        """Every conversation's held state (cloned) and random streams, before a step that may fail."""
        return {c.name: ([t.clone() if isinstance(t, torch.Tensor) else t for t in c.held], c.rng())
                for c in self.convs}

    def check_intact(self, before: dict, what: str) -> None:
        """Every conversation's held state and random streams are as ``before`` (the failed step undone)."""
        for c in self.convs:
            held, rng = before[c.name]
            for i, (a, b) in enumerate(zip(held, c.held)):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (
                    f"{what}: {c.name}'s held state of region r{i} changed")
            assert torch.equal(rng, c.rng()), f"{what}: {c.name}'s random streams changed"

    def good_call(self, c: Conv, out: Any = None, counts: dict | None = None) -> None:
        """One call that succeeds: every output equals the solo run's at this step (``out``: what the
        call returned, made by the caller, with ``counts`` the program's state counts before it)."""
        spec = self.spec
        # one lane: a session's call copies the default program's state out of it, and the next default
        # call copies it back in (its state views are no longer in place)
        in_place = c.session is None and self.lanes > 1 and c.views is not None and \
            all(a is b for a, b in zip(c.held, c.views))
        counts = counts if counts is not None else self.prog.state_counts()
        if out is None:
            out = c.call(*_args(spec, _x(spec, c.seed, c.step), c.held))
        out = _as_list(out)
        got = [t.clone() for t in out]
        want = c.solo[c.step]
        assert len(got) == len(want), f"{c.name} step {c.step}: {len(got)} outputs, the solo run has {len(want)}"
        for j, (a, b) in enumerate(zip(want, got)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (
                f"{c.name} step {c.step}, output {j}: differs from the solo run "
                f"({tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
                + (f", max abs diff {(a - b).abs().max().item()!r})" if a.shape == b.shape and a.numel() else ")"))
        if in_place:  # the state the last call returned, fed back: used in place, not copied
            after = self.prog.state_counts()
            used = after["in_place"] - counts["in_place"]
            assert used == len(self.names) and after["adopted"] == counts["adopted"], (
                f"{c.name} step {c.step}: the state the last call returned was not used in place ({counts} -> {after})")
        c.got += got
        c.want += want
        new = _states(spec, out)
        if c.views is not None:
            c.stale = c.views
        c.views, c.held = new, list(new)
        c.step += 1

    # -------------------------------------------------------------- faults
    def op_fault(self, c: Conv, frac: int, kind: str) -> None:
        """The call with an exception at a drawn op; a call that ends before that op is a good call."""
        args = _args(self.spec, _x(self.spec, c.seed, c.step), c.held)
        n = self.op_count(c, args)
        mode = FaultAt(frac * n // 1000, kind, of=n)  # 999: the call's last op
        before, counts = self.before(), self.prog.state_counts()
        out, raised = _attempt(lambda: c.call(*args), mode)
        if not mode.fired:
            assert raised is None, f"{c.name}: raised {raised!r} with no fault injected"
            event("call fault: past the call's last op (a good call)")
            self.good_call(c, out, counts)
            return
        event(f"call fault: {kind}")
        event(f"call fault on {'a session' if c.session is not None else 'the default program'}"
              f"{' (its last tenth)' if mode.k * 10 >= 9 * mode.of else ''}")
        what = f"{c.name} step {c.step}: {kind} at op {mode.k} ({mode.op})"
        assert raised is mode.raised, f"{what}: raised {raised!r} instead of the injected exception"
        self.check_intact(before, what)

    def bad_call(self, c: Conv, kind: str, region: int) -> None:
        spec = self.spec
        if kind == "stale" and c.stale is None:
            kind = "state_float64"
        i = region % len(self.names)
        x = _x(spec, c.seed, c.step)
        args, kwargs = _args(spec, x, c.held), {}
        pos = spec.in_pos(1 + i)
        t = c.held[i]
        if kind == "state_float64":
            args[pos] = t.double()
        elif kind == "state_shape":
            d = next(d for d in range(t.dim()) if d != spec.regions[i].axis)
            shape = list(t.shape)
            shape[d] += 1
            args[pos] = torch.zeros(shape)
        elif kind == "state_rank":
            args[pos] = t.unsqueeze(0)
        elif kind == "state_none":
            args[pos] = None
        elif kind == "state_list":
            args[pos] = t.tolist()
        elif kind == "x_float64":
            args[spec.in_pos(0)] = x.double()
        elif kind == "extra_arg":
            args.append(x)
        elif kind == "kwarg":
            kwargs = {"temperature": x}
        else:  # stale: the whole state an older call returned (a class of the catalog)
            args = _args(spec, x, c.stale)
        before = self.before()
        _, raised = _attempt(lambda: c.call(*args, **kwargs))
        event(f"bad input: {kind}")
        what = f"{c.name} step {c.step}: bad input {kind} on r{i}"
        assert isinstance(raised, BAD_CALLS[kind]), f"{what}: raised {raised!r}, not {BAD_CALLS[kind].__name__}"
        self.check_intact(before, what)

    def snapshot(self, c: Conv, fault: tuple | None) -> None:
        if c.session is None:  # the default program: clone the state it holds (fed back later, copied in)
            c.snap = ([t.clone() for t in c.held], torch.get_rng_state(), c.step)
            return
        if c.views is None:
            return  # nothing returned yet: no turn boundary
        if fault is not None:
            mode = FaultAt(fault[0] * self.ops["snapshot"] // 1000, fault[1])
            before = self.before()
            _, raised = _attempt(c.session.snapshot, mode)
            if mode.fired:
                assert raised is mode.raised, f"{c.name}: a faulted snapshot raised {raised!r}"
                self.check_intact(before, f"{c.name} step {c.step}: a faulted snapshot")
                event("snapshot fault")
        c.snap = (c.session.snapshot(), c.step)

    def restore(self, c: Conv, fault: tuple | None, then_restore: bool) -> None:
        if c.snap is None:
            return
        if c.session is None:
            state, rng, step = c.snap
            c.held = [t.clone() for t in state]
            torch.set_rng_state(rng)
            c.step = step
            event("restore (default program: a cloned state fed back)")
            return
        snap, step = c.snap
        s = c.session
        if fault is not None and fault[0] == "op":
            mode = FaultAt(fault[1] * self.ops["restore"] // 1000, fault[2])
            before = self.before()
            restored, raised = _attempt(lambda: s.restore(snap), mode)
            if not mode.fired:
                assert raised is None, f"{c.name}: a restore raised {raised!r} with no fault injected"
                self._restored(c, restored, step)
                return
            event(f"restore fault: {fault[2]}")
            assert raised is mode.raised, f"{c.name}: a faulted restore raised {raised!r}"
            self.check_intact(before, f"{c.name} step {c.step}: {fault[2]} at op {mode.k} ({mode.op}) of a restore")
        elif fault is not None:
            kind = fault[1]
            bad = bad_snapshot(snap, kind, self.spec)
            before = self.before()
            _, raised = _attempt(lambda: s.restore(bad))
            event(f"bad snapshot: {kind}")
            assert isinstance(raised, BAD_SNAPSHOTS[kind]), (
                f"{c.name}: restore of a bad snapshot ({kind}) raised {raised!r}, not {BAD_SNAPSHOTS[kind].__name__}")
            self.check_intact(before, f"{c.name} step {c.step}: a bad snapshot ({kind})")
        if then_restore:
            self._restored(c, s.restore(snap), step)

    def _restored(self, c: Conv, restored: dict, step: int) -> None:
        event("restore")
        assert sorted(restored) == self.names, f"{c.name}: restore returned regions {sorted(restored)}"
        if c.views is not None:
            c.stale = c.views
        c.views = [restored[n] for n in self.names]
        c.held, c.step = list(c.views), step


def bad_snapshot(snap: cf.Snapshot, kind: str, spec: ModelSpec):
    """``snap`` with its last region's state made wrong (the others right: a restore checks all first)."""
    if kind == "not_a_snapshot":
        return dict(snap.state)
    state = dict(snap.state)
    name = sorted(state)[-1]
    t = state[name]
    if kind == "float64":
        state[name] = t.double()
    elif kind == "shape":
        axis = spec.regions[int(name[1:])].axis
        shape = list(t.shape)
        shape[next(d for d in range(t.dim()) if d != axis)] += 1
        state[name] = torch.zeros(shape)
    elif kind == "rank":
        state[name] = t.unsqueeze(0)
    elif kind == "unknown_region":
        state["not_a_region"] = t.clone()
    else:
        state[name] = 1.0
    return cf.Snapshot(state, snap.rng)


# -------------------------------------------------------------------------------------------- property

# where in the call's ops the fault lands, in thousandths: anywhere, in the last tenth (the state writes,
# the commit), or at the last op (a session's commit)
_FRAC = st.one_of(st.integers(0, 999), st.integers(900, 999), st.just(999))
_EXC = st.sampled_from(["fault", "fault", "oom", "interrupt"])

_SNAPSHOT_FAULT = st.one_of(st.none(), st.tuples(_FRAC, _EXC))
_RESTORE_FAULT = st.one_of(st.none(), st.tuples(st.just("op"), _FRAC, _EXC),
                           st.tuples(st.just("bad"), st.sampled_from(sorted(BAD_SNAPSHOTS))))
_THEN = st.sampled_from([True, True, False])  # False: only the failed restore (the session as it was)

_PRE = st.one_of(
    st.tuples(st.just("op"), _FRAC, _EXC),
    st.tuples(st.just("op"), _FRAC, _EXC),
    st.tuples(st.just("bad"), st.sampled_from(sorted(BAD_CALLS)), st.integers(0, 1)),
    st.tuples(st.just("snapshot"), _SNAPSHOT_FAULT),
    st.tuples(st.just("restore"), _RESTORE_FAULT, _THEN),
)


@dataclass(frozen=True)
class Schedule:
    """One program of a drawn model and the conversations through it: ``steps`` are (conversation,
    what comes before its next call); conversations ``0 .. sessions - 1`` are sessions, the last one
    the default program when ``default``."""

    replay: str
    lanes: int
    sessions: int
    default: bool
    steps: tuple


@st.composite
def schedules(draw, lanes: int, default: bool) -> Schedule:
    replay = draw(st.sampled_from(["fake", "off"]))
    sessions = draw(st.integers(1, 3))
    convs = sessions + default
    calls = [draw(st.integers(2, 5)) for _ in range(convs)]
    order = draw(st.permutations([i for i in range(convs) for _ in range(calls[i])]))
    steps: list[tuple[int, list]] = [(i, []) for i in order]
    for i in range(convs):
        mine = [n for n, (j, _) in enumerate(steps) if j == i]
        # before one to three of its calls, a fault (then the call itself: the retry), drawn per
        # conversation so that each one gets its faults
        for n in draw(st.lists(st.integers(0, len(mine) - 1), min_size=1, max_size=3)):
            steps[mine[n]][1].append(draw(_PRE))
        # in most, a snapshot before one call (after its first) and a restore before a later one
        if len(mine) >= 3 and draw(st.integers(0, 2)):
            at = draw(st.sampled_from(mine[1:-1]))
            back = draw(st.sampled_from([n for n in mine if n > at]))
            steps[at][1].append(("snapshot", draw(_SNAPSHOT_FAULT)))
            steps[back][1].insert(0, ("restore", draw(_RESTORE_FAULT), draw(_THEN)))
    return Schedule(replay, lanes, sessions, default, tuple((i, tuple(pre)) for i, pre in steps))


@st.composite
def cases(draw):
    """A model (built once) and two programs of it: one lane, where a session's call takes the lane
    from the one before it; two lanes, sessions on the second and the default program on the first."""
    spec = draw(small_models())
    noise = draw(st.integers(0, 2)) == 0
    return spec, noise, (draw(schedules(1, False)), draw(schedules(2, True)))


_PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if os.environ.get("CADENCE_FX_SHRINK")
                                                          else ())
_SETTINGS = dict(deadline=None, derandomize=True, phases=_PHASES, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run_case(spec: ModelSpec, noise: bool, sched: Schedule) -> Harness:
    contract, eps = build(spec, noise)
    prog = cf.optimize(eps, contract, replay=FakeBackend() if sched.replay == "fake" else "off", lanes=sched.lanes)
    if sched.replay == "fake":
        prog.warmup(*example_args(spec, {f"r{i}": r.initial for i, r in enumerate(spec.regions)}))
    ref = cf.reference(eps)
    h = Harness(spec, prog, ref, sched.lanes)
    h.calibrate(sched.default)
    for c in range(sched.sessions):
        seed = 11 + 7 * c
        h.add(Conv(f"session {c}", None, None, seed, _prompt(spec, seed), Solo(spec, ref, seed)))
    if sched.default:
        h.add(Conv("default", prog, None, 5, _prompt(spec, 5), Solo(spec, ref, 5)))
    for c in h.convs[:sched.sessions]:
        c.session = prog.session(c.name, seed=c.seed)
        c.call = c.session
    torch.manual_seed(5)  # the default program draws from the process's generator, as its solo run did
    for i, pre in sched.steps:
        c = h.convs[i]
        for p in pre:
            note(f"{c.name} step {c.step}: {p}")
            if p[0] == "op":
                h.op_fault(c, p[1], p[2])
            elif p[0] == "bad":
                h.bad_call(c, p[1], p[2])
            elif p[0] == "snapshot":
                h.snapshot(c, p[1])
            else:
                h.restore(c, p[1], p[2])
        note(f"{c.name} step {c.step}: call")
        h.good_call(c)
    for c in h.convs:
        assert sha256_tensors(c.got) == sha256_tensors(c.want), f"{c.name}: the stream's SHA-256 differs from solo"
    return h


@settings(max_examples=25, **_SETTINGS)
@given(cases())
def test_faults_leave_every_conversation_equal_to_its_solo_run(case):
    """Faults at any op, bad inputs, snapshots and faulted restores, interleaved over sessions and the
    default program: every good call of every conversation is its solo unmodified run's, bit for bit."""
    spec, noise, scheds = case
    note(f"spec = {spec!r}, noise={noise}")
    for sched in scheds:
        note(f"--- replay={sched.replay} lanes={sched.lanes} sessions={sched.sessions} default={sched.default}")
        event(f"replay {sched.replay}, lanes {sched.lanes}")
        run_case(spec, noise, sched)


# ------------------------------------------------------------------------------ deterministic cases

# two regions (a growing window, a ring carry read by a conv), an output returning the incoming state,
# one wrapped block (replayed by FakeBackend), a draw of randomness every call
SPEC = ModelSpec(dim=3, chunk=1, regions=(
    RegionSpec("kv", "BTC", (1, 2), "old_new", ("window", 3), initial=1),
    RegionSpec("carry", "CT", (2,), "new_old", ("ring", 2), initial=2, readout="conv")),
    aux="input", in_perm=(1, 0, 2), wrap=("blocks.0",), seed=3)


def _program(replay: str, lanes: int):
    contract, eps = build(SPEC, True)
    prog = cf.optimize(eps, contract, replay=FakeBackend() if replay == "fake" else "off", lanes=lanes)
    if replay == "fake":
        prog.warmup(*example_args(SPEC, {"r0": 1, "r1": 2}))
    return prog, cf.reference(eps)


def _harness(replay: str) -> tuple[Harness, Conv, Conv]:
    """A session and the default program, two conversations of a fresh program of :data:`SPEC` on 2 lanes."""
    prog, ref = _program(replay, 2)
    h = Harness(SPEC, prog, ref, 2)
    h.calibrate(default=True)
    s = Conv("session", None, None, 22, _prompt(SPEC, 22), Solo(SPEC, ref, 22))
    d = Conv("default", prog, None, 21, _prompt(SPEC, 21), Solo(SPEC, ref, 21))
    s.session = s.call = prog.session("s", seed=s.seed)
    torch.manual_seed(d.seed)  # the default program draws from the process's generator, as its solo run
    h.add(s)
    h.add(d)
    return h, s, d


def _frac(k: int, n: int) -> int:
    """The thousandths that :class:`FaultAt` turns back into op ``k`` of ``n``."""
    return -(-k * 1000 // n)


@pytest.mark.parametrize("replay", ["off", "fake"])
def test_a_fault_at_every_op_of_a_call_is_undone(replay):
    """An exception, an out-of-memory error or a KeyboardInterrupt at each op of a call in turn, up to
    the call's last (a session's call; the default program's, fed the state its last call returned and
    fed a copy of it), a few failed calls in a row before each retry: every conversation's state and
    random streams as before each failure, and every retry is the solo run's call."""
    row = 4  # failed calls before a retry
    h, s, d = _harness(replay)
    for c in (s, d, s, d, s, d):
        h.good_call(c)  # past the prompt's classes: every call below is of one class
    fired = {}
    for c, foreign in ((s, False), (d, False), (d, True)):
        for k in itertools.count():
            if foreign:  # a state that is no view of the program's: the copy-in path
                c.held = [t.clone() for t in c.held]
            kind = ["fault", "oom", "interrupt"][k % 3]
            mode = FaultAt(k, kind)
            args = _args(SPEC, _x(SPEC, c.seed, c.step), c.held)
            before, counts = h.before(), h.prog.state_counts()
            out, raised = _attempt(lambda: c.call(*args), mode)
            if not mode.fired:  # past the call's last op: a good call, and the end of the loop
                assert raised is None, f"{c.name}, op {k}: raised {raised!r} with no fault injected"
                h.good_call(c, out, counts)
                fired[c.name, foreign] = k
                break
            fed = "a copy of its state" if foreign else "its state fed back"
            what = f"{c.name} ({fed}): {kind} at op {k} ({mode.op})"
            assert raised is mode.raised, f"{what}: raised {raised!r} instead"
            h.check_intact(before, what)
            if k % row == row - 1:
                h.good_call(c)  # the retry: the solo run's call
    assert min(fired.values()) > 40, fired  # each path had that many ops, each one failed once
    if replay == "fake":  # the wrapped block was replayed (the faults hit the replay's copies too)
        assert h.prog.counters()["replays"] > 0, h.prog.counters()
    for c in (s, d):
        assert sha256_tensors(c.got) == sha256_tensors(c.want), c.name


def test_a_bad_input_is_refused_and_leaves_the_state():
    """Each bad input (on each region) to a session and to the default program: the class the library
    raises for it, every state as before, and the next call is the solo run's."""
    h, s, d = _harness("off")
    for c in (s, d, s, d):
        h.good_call(c)  # an older state to feed back (stale)
    for kind in sorted(BAD_CALLS):
        for c in (s, d):
            h.bad_call(c, kind, 0)
            h.bad_call(c, kind, 1)
            h.good_call(c)


def test_restore_after_faults_and_a_restore_that_raises():
    """A snapshot (one faulted first), calls, restores that raise at each of their ops or get a bad
    snapshot (the session as it was), then the restore: the session continues as its solo run from
    the snapshot's step. The default program beside it, restored from a clone of its state."""
    h, c, d = _harness("fake")
    h.good_call(c)
    h.op_fault(c, 500, "interrupt")
    h.good_call(c)
    assert c.step == 2
    h.snapshot(c, (500, "fault"))
    h.snapshot(d, None)
    h.good_call(d)
    h.good_call(c)
    h.op_fault(c, 0, "fault")
    h.good_call(c)
    h.good_call(d)
    n = h.ops["restore"]
    for k in range(n):
        h.restore(c, ("op", _frac(k, n), ["fault", "interrupt"][k % 2]), False)
    for kind in sorted(BAD_SNAPSHOTS):
        h.restore(c, ("bad", kind), False)
    h.good_call(c)  # none of those restored anything: the session goes on from where it was
    assert c.step == 5
    h.restore(c, None, True)
    h.restore(d, None, True)
    assert c.step == 2 and d.step == 0
    h.good_call(c)
    h.good_call(d)
    h.bad_call(c, "stale", 0)  # the state views from before the restore
    h.good_call(c)
    for x in (c, d):
        assert sha256_tensors(x.got) == sha256_tensors(x.want), x.name
