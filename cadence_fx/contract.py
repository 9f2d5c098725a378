"""The native-clock contract: what a user declares about one streaming step.

A contract names the model's clocks, its persistent state regions with their
retention policies, and the callables whose boundaries become replay
partitions. Everything else (buffer sizes, the signature catalog) is derived
from it by :mod:`cadence_fx.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Union

Order = Literal["old_new", "new_old"]

#: ``Contract.wrap`` entry that wraps the whole step: the root module's path, on every node's stack.
WHOLE_STEP = ""


class ContractError(ValueError):
    """A contract that is inconsistent with itself or with the exported program."""


@dataclass(frozen=True)
class Clock:
    """A counter the model advances by a fixed ``stride`` per call (frames, solver steps, samples)."""

    name: str
    stride: int
    unit: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ContractError("Clock.name: must be a non-empty string")
        if not isinstance(self.stride, int) or self.stride <= 0:
            raise ContractError(f"Clock {self.name!r}: stride must be a positive int, got {self.stride!r}")


@dataclass(frozen=True)
class HeadTail:
    """Keep the first ``head`` and the last ``tail`` positions once the extent exceeds ``head + tail``.

    This is what the stock Token2Wav driver does: ``cat([x[:prompt], x[-100:]])``.
    """

    head: int
    tail: int

    def __post_init__(self) -> None:
        _check_retention("HeadTail", self)

    def bound(self) -> int:
        return self.head + self.tail

    def apply(self, extent: int) -> int:
        return extent if extent <= self.bound() else self.bound()


@dataclass(frozen=True)
class SlidingWindow:
    """Keep the last ``size`` positions."""

    size: int

    def __post_init__(self) -> None:
        _check_retention("SlidingWindow", self)

    def bound(self) -> int:
        return self.size

    def apply(self, extent: int) -> int:
        return min(extent, self.size)


@dataclass(frozen=True)
class Ring:
    """A region of fixed ``capacity``: a cache the model overwrites in place (Moshi-style ring), or a
    fixed-size context it rebuilds whole every call (a causal conv's left context).

    ``Region.order`` on a Ring says how the model concatenates the region when it does
    (``cat([ctx, new])`` then the last ``capacity`` positions) and must be ``None`` when it never
    concatenates it (it writes positions in place); both are checked against the graph. A Ring may
    start empty (``initial=0``, a history with nothing in it yet) or full (``initial=capacity``).
    """

    capacity: int

    def __post_init__(self) -> None:
        _check_retention("Ring", self)

    def bound(self) -> int:
        return self.capacity

    def apply(self, extent: int) -> int:
        return self.capacity


Retention = Union[HeadTail, SlidingWindow, Ring]


@dataclass(frozen=True)
class Phase:
    """Which program of a catalog runs a call when programs share an input signature.

    A step whose code path depends on a position (the first call of a stream, a prefill, a warm
    start) exports one program per phase, all with the same shapes. ``input`` names a scalar input
    (a Python int, or an integer tensor of one element: its value is read on the host, a device
    sync on a GPU) and ``at`` the boundaries: phase 0 takes values below ``at[0]``, phase k values in
    ``[at[k-1], at[k])``, the last phase the rest. Each program's phase is its example value's (the
    value it was exported with, ``ep.example_inputs``).
    """

    input: str
    at: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.input, str) or not self.input:
            raise ContractError("Phase.input: must name a scalar input")
        at = tuple(self.at) if isinstance(self.at, (tuple, list)) else None
        if not at or any(not _is_int(a) for a in at) or list(at) != sorted(set(at)):
            raise ContractError(f"Phase.at: a non-empty increasing tuple of ints, got {self.at!r}")
        object.__setattr__(self, "at", at)

    def of(self, value: int) -> int:
        """The phase of scalar value ``value``."""
        return sum(1 for a in self.at if value >= a)


@dataclass(frozen=True)
class Region:
    """One persistent state region of the step.

    Attributes:
        name: label used in plans, errors and counters.
        input: name of the exported program's user input that carries the region in, or the name
            (as in ``ep.state_dict``) of a module buffer the program mutates (a cache registered with
            ``register_buffer`` and written in place: gpt-fast's ``KVCache``, transformers'
            ``StaticCache``), with ``output=None``.
        output: index into the program's user outputs that carries the region out; ``None`` for a
            module buffer: the optimized program then holds the state itself (neither passed in nor
            returned; each session has its own), starting from the buffer's value at export.
        clock: name of the clock that advances the region's ``axis``.
        axis: the clock axis of the region tensor (negative values count from the end).
        order: how the model concatenates: ``"old_new"`` (``cat([cache, new])``) or
            ``"new_old"`` (``cat([new, cache])``). Declared, checked, reproduced; never "fixed".
            ``None`` only for a :class:`Ring` the model writes in place without concatenating.
        retention: the policy that bounds the extent.
        initial: extent of the region at the first call after setup (the prompt), e.g. 302.
        growth: positions appended per call; defaults to the clock's stride.
        live: dims other than ``axis`` whose stock capacity exceeds what is ever written and
            read, mapped to the live size (e.g. ``{0: 10}`` for 10 of 16 solver-step slots).
    """

    name: str
    input: str
    output: int | None
    clock: str
    axis: int
    order: Order | None
    retention: Retention
    initial: int
    growth: int | None = None
    live: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"Region {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ContractError("Region.name: must be a non-empty string")
        for attr in ("input", "clock"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ContractError(f"{where}.{attr}: must be a non-empty string, got {getattr(self, attr)!r}")
        for attr in ("output", "axis"):
            if attr == "output" and self.output is None:
                continue  # a module buffer the program mutates
            if not _is_int(getattr(self, attr)):
                raise ContractError(f"{where}.{attr}: must be an int, got {getattr(self, attr)!r}")
        _check_retention(f"{where}.retention", self.retention)
        ring = isinstance(self.retention, Ring)
        if self.order not in ("old_new", "new_old") and not (ring and self.order is None):
            allowed = "'old_new', 'new_old' or None" if ring else "'old_new' or 'new_old' (None only for a Ring)"
            raise ContractError(f"{where}.order: must be {allowed}, got {self.order!r}")
        if not _is_int(self.initial) or self.initial < 0:
            raise ContractError(f"{where}.initial: must be a non-negative int, got {self.initial!r}")
        if isinstance(self.retention, Ring) and self.initial not in (0, self.retention.capacity):
            raise ContractError(f"{where}.initial: a Ring region starts empty (0) or full "
                                f"({self.retention.capacity}), got initial={self.initial}")
        if self.growth is not None and (not _is_int(self.growth) or self.growth <= 0):
            raise ContractError(f"{where}.growth: must be a positive int, got {self.growth!r}")
        for d, n in dict(self.live).items():
            if not _is_int(d) or not _is_int(n) or n <= 0:
                raise ContractError(f"{where}.live[{d!r}]: must map a dim to a positive int, got {n!r}")


@dataclass(frozen=True)
class Contract:
    """A native-clock contract for one streaming step.

    Attributes:
        clocks: the model's clocks.
        regions: the persistent state regions.
        wrap: module paths (as in the exported program's ``nn_module_stack``) whose calls become
            replay partitions. A path wraps every node whose stack contains it; ``WHOLE_STEP``
            (``""``, the root) wraps the whole step, solver loops written inline in ``forward`` included.
        admit: optional predicate deciding whether a catalog class may be replayed. It receives
            the clock strides by clock name and the region extents by region name, e.g.
            ``lambda c: c["frame"] <= 50``; refused classes run eagerly, counted.
        hoist_constants: compute host-built constants (and what the step computes from them alone,
            such as a fixed solver schedule's timestep embeddings) once, into device buffers.
        fold_weights: also compute weight-derived constants once (weight norm, Snake's
            ``1/alpha``), with the stock kernels, on the weights' device. Needs ``hoist_constants``.
            Either way the weights a hoisted cone reads are read once: an in-place change of one
            afterwards raises ``WeightsChanged`` on the next call.
        split_at: module paths inside a wrapped callable whose every invocation starts a new graph
            of that callable's partition (the clock stays the wrapped callable's: the segments are
            captured, keyed and replayed together per call). A graph's launch costs host time that
            grows with its node count; segments at the solver steps of a 10,000-node CFM loop let
            each launch overlap the previous segment's execution.
        phase: tells apart programs that share an input signature (:class:`Phase`).
    """

    clocks: tuple[Clock, ...]
    regions: tuple[Region, ...] = ()
    wrap: tuple[str, ...] = ()
    admit: Callable[[Mapping[str, int]], bool] | None = None
    hoist_constants: bool = True
    fold_weights: bool = True
    split_at: tuple[str, ...] = ()
    phase: Phase | None = None

    def clock(self, name: str) -> Clock:
        for c in self.clocks:
            if c.name == name:
                return c
        raise ContractError(f"no clock named {name!r}; declared clocks: {[c.name for c in self.clocks]}")

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise ContractError(f"no region named {name!r}")

    def growth(self, region: Region) -> int:
        return region.growth if region.growth is not None else self.clock(region.clock).stride

    def __post_init__(self) -> None:
        self.validate_self()

    def validate_self(self) -> None:
        """Checks that need no program: names, policies, bounds, one region per input and output."""
        for c in self.clocks:
            if not isinstance(c, Clock):
                raise ContractError(f"Contract.clocks: expected Clock entries, got {c!r}")
        names = [c.name for c in self.clocks]
        if len(set(names)) != len(names):
            raise ContractError(f"Contract.clocks: duplicate clock names {names}")
        seen: dict[str, dict[object, str]] = {"name": {}, "input": {}, "output": {}}
        for r in self.regions:
            if not isinstance(r, Region):
                raise ContractError(f"Contract.regions: expected Region entries, got {r!r}")
            where = f"Region {r.name!r}"
            for attr in ("name", "input", "output"):
                value = getattr(r, attr)
                if value is None:  # output=None: a module buffer, which its input names alone
                    continue
                if value in seen[attr]:
                    other = seen[attr][value]
                    raise ContractError(
                        f"{where}.{attr}: {value!r} is already region {other!r}'s; one input or output carries "
                        f"one region (a second declaration would give it a second buffer)" if attr != "name"
                        else f"{where}: duplicate region name")
                seen[attr][value] = r.name
            self.clock(r.clock)  # raises with the list of clocks
        if self.phase is not None and not isinstance(self.phase, Phase):
            raise ContractError(f"Contract.phase: a Phase, got {self.phase!r}")
        for field_name, paths in (("wrap", self.wrap), ("split_at", self.split_at)):
            if isinstance(paths, str):
                raise ContractError(f"Contract.{field_name}: a tuple of module paths, got the string {paths!r}")
            for w in paths:
                if not isinstance(w, str) or (not w and field_name == "split_at"):
                    raise ContractError(f"Contract.{field_name}: entries must be module paths, got {w!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_retention(where: str, pol: object) -> None:
    if pol is None:
        raise ContractError(f"{where}: unbounded retention (None) is not allowed; "
                            "declare HeadTail, SlidingWindow or Ring")
    if isinstance(pol, HeadTail):
        if not (_is_int(pol.head) and _is_int(pol.tail)) or pol.head < 0 or pol.tail < 0 or pol.head + pol.tail == 0:
            raise ContractError(f"{where}: HeadTail(head={pol.head!r}, tail={pol.tail!r}) needs non-negative "
                                "int head and tail, not both zero")
    elif isinstance(pol, SlidingWindow):
        if not _is_int(pol.size) or pol.size <= 0:
            raise ContractError(f"{where}: SlidingWindow(size={pol.size!r}) needs a positive int size")
    elif isinstance(pol, Ring):
        if not _is_int(pol.capacity) or pol.capacity <= 0:
            raise ContractError(f"{where}: Ring(capacity={pol.capacity!r}) needs a positive int capacity")
    else:
        raise ContractError(f"{where}: unknown retention policy {pol!r}; declare HeadTail, SlidingWindow or Ring")
