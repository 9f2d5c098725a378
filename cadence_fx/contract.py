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
Lifetime = Literal["call", "chunk", "turn", "session"]


class ContractError(ValueError):
    """A contract that is inconsistent with itself or with the exported program."""


@dataclass(frozen=True)
class Clock:
    """A counter the model advances by a fixed ``stride`` per call (frames, solver steps, samples)."""

    name: str
    stride: int
    unit: str = ""

    def __post_init__(self) -> None:
        if not self.name:
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

    def bound(self) -> int:
        return self.head + self.tail

    def apply(self, extent: int) -> int:
        return extent if extent <= self.bound() else self.bound()


@dataclass(frozen=True)
class SlidingWindow:
    """Keep the last ``size`` positions."""

    size: int

    def bound(self) -> int:
        return self.size

    def apply(self, extent: int) -> int:
        return min(extent, self.size)


@dataclass(frozen=True)
class Ring:
    """A cache of fixed ``capacity`` that the model overwrites in place (Moshi-style ring)."""

    capacity: int

    def bound(self) -> int:
        return self.capacity

    def apply(self, extent: int) -> int:
        return self.capacity


Retention = Union[HeadTail, SlidingWindow, Ring]


@dataclass(frozen=True)
class Region:
    """One persistent state region of the step.

    Attributes:
        name: label used in plans, errors and counters.
        input: name of the exported program's user input that carries the region in.
        output: index into the program's user outputs that carries the region out.
        clock: name of the clock that advances the region's ``axis``.
        axis: the clock axis of the region tensor (negative values count from the end).
        order: how the model concatenates: ``"old_new"`` (``cat([cache, new])``) or
            ``"new_old"`` (``cat([new, cache])``). Declared, checked, reproduced; never "fixed".
        retention: the policy that bounds the extent.
        initial: extent of the region at the first call after setup (the prompt), e.g. 302.
        growth: positions appended per call; defaults to the clock's stride.
        lifetime: how long the region lives; ``"turn"`` regions may be restored from snapshots.
        live: dims other than ``axis`` whose stock capacity exceeds what is ever written and
            read, mapped to the live size (e.g. ``{0: 10}`` for 10 of 16 solver-step slots).
    """

    name: str
    input: str
    output: int
    clock: str
    axis: int
    order: Order
    retention: Retention
    initial: int
    growth: int | None = None
    lifetime: Lifetime = "turn"
    live: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Contract:
    """A native-clock contract for one streaming step.

    Attributes:
        clocks: the model's clocks.
        regions: the persistent state regions.
        wrap: module paths (as in the exported program's ``nn_module_stack``) whose calls become
            replay partitions. A path wraps every node whose stack contains it.
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
    """

    clocks: tuple[Clock, ...]
    regions: tuple[Region, ...] = ()
    wrap: tuple[str, ...] = ()
    admit: Callable[[Mapping[str, int]], bool] | None = None
    hoist_constants: bool = True
    fold_weights: bool = True
    split_at: tuple[str, ...] = ()

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

    def validate_self(self) -> None:
        """Checks that need no program: names, policies, bounds."""
        names = [c.name for c in self.clocks]
        if len(set(names)) != len(names):
            raise ContractError(f"Contract.clocks: duplicate clock names {names}")
        seen: set[str] = set()
        for r in self.regions:
            where = f"Region {r.name!r}"
            if r.name in seen:
                raise ContractError(f"{where}: duplicate region name")
            seen.add(r.name)
            self.clock(r.clock)  # raises with the list of clocks
            if r.order not in ("old_new", "new_old"):
                raise ContractError(f"{where}.order: must be 'old_new' or 'new_old', got {r.order!r}")
            if r.lifetime not in ("call", "chunk", "turn", "session"):
                raise ContractError(f"{where}.lifetime: unknown lifetime {r.lifetime!r}")
            _check_retention(where, r.retention)
            if not isinstance(r.initial, int) or r.initial < 0:
                raise ContractError(f"{where}.initial: must be a non-negative int, got {r.initial!r}")
            g = self.growth(r)
            if g <= 0:
                raise ContractError(f"{where}.growth: must be positive, got {g}")
            if isinstance(r.retention, Ring) and r.initial not in (0, r.retention.capacity):
                raise ContractError(
                    f"{where}.initial: a Ring region always has its capacity "
                    f"({r.retention.capacity}) as extent, got initial={r.initial}"
                )
            for d, n in r.live.items():
                if not isinstance(n, int) or n <= 0:
                    raise ContractError(f"{where}.live[{d}]: must be a positive int, got {n!r}")
        for w in self.wrap:
            if not isinstance(w, str) or not w:
                raise ContractError(f"Contract.wrap: entries must be non-empty module paths, got {w!r}")


def _check_retention(where: str, pol: object) -> None:
    if pol is None:
        raise ContractError(f"{where}.retention: unbounded retention (None) is not allowed; "
                            "declare HeadTail, SlidingWindow or Ring")
    if isinstance(pol, HeadTail):
        if pol.head < 0 or pol.tail < 0 or pol.head + pol.tail == 0:
            raise ContractError(f"{where}.retention: HeadTail(head={pol.head}, tail={pol.tail}) "
                                "must keep a positive, non-negative head and tail")
    elif isinstance(pol, SlidingWindow):
        if pol.size <= 0:
            raise ContractError(f"{where}.retention: SlidingWindow(size={pol.size}) must be positive")
    elif isinstance(pol, Ring):
        if pol.capacity <= 0:
            raise ContractError(f"{where}.retention: Ring(capacity={pol.capacity}) must be positive")
    else:
        raise ContractError(f"{where}.retention: unknown policy {pol!r}")
