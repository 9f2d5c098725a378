"""Replayed runners: the replay engines installed on an annotated graph, and the warm-up that captures them.

``mark_replay`` leaves a :class:`~cadence_fx.annotations.ReplaySpec` on every wrapped partition's call
node. :func:`install_runners` puts a :class:`ReplayRunner` (an :class:`ExactShapeReplay` over the
partition) in place of each partition module. A runner captures a new class only while a
:class:`CaptureSession` is open (warm-up); outside it, a class it has not captured runs eagerly,
counted by reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.fx import GraphModule

from cadence_fx.annotations import RANDOM, replay_spec
from cadence_fx.runtime.backends import ReplayBackend
from cadence_fx.runtime.exact_replay import ExactShapeReplay, ProbeVerdict
from cadence_fx.runtime.staging import StagingArena
from cadence_fx.runtime import rng as rng_mod
from cadence_fx.runtime.rng import active_session_rng, draw_random, drawing

log = logging.getLogger(__name__)

__all__ = ["CaptureGate", "CaptureSession", "RandomGuard", "ReplayRunner", "RunnerSet", "install_runners",
           "isolate_randomness"]


@dataclass
class CaptureSession:
    """An open warm-up: runners capture unseen classes; ``restored_by_caller`` names the storages the
    caller snapshots and restores around the whole warm-up (captures need not snapshot them)."""

    restored_by_caller: frozenset[int] = frozenset()
    captured: int = 0


class CaptureGate:
    """Shared by every runner of one program: whether a capture session is open."""

    def __init__(self) -> None:
        self.session: CaptureSession | None = None

    @contextmanager
    def open(self, restored_by_caller: frozenset[int]) -> Iterator[CaptureSession]:
        if self.session is not None:
            raise RuntimeError("a capture session is already open")
        self.session = CaptureSession(restored_by_caller)
        try:
            yield self.session
        finally:
            self.session = None


class ReplayRunner(torch.nn.Module):
    """A wrapped partition behind the replay engine; captures a new class only inside a capture session."""

    def __init__(self, fn: torch.nn.Module, engine: ExactShapeReplay, gate: CaptureGate, *, random: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.engine = engine
        self.gate = gate
        self.random = random  # draws: replayed (or run eagerly) with the calling session's streams
        # why it draws, for the counters: an op of its graph says so, or a capture's probe saw the device
        # generator move (a kernel that takes an offset although no op is a declared draw)
        engine.draws = "declared" if random else None

    def forward(self, *args: Any) -> Any:
        session = self.gate.session
        if session is not None:
            key = self.engine.signature(args)
            if key is not None and key not in self.engine.classes:
                report = self.engine.capture(*args, restored_by_caller=session.restored_by_caller)
                session.captured += int(report.admitted)
                if report.effect == "device_rng" and not self.random:
                    # the probe saw a draw the graph's ops did not announce: replay it as one that draws
                    log.warning("partition %s draws from the device generator although no op in it is a "
                                "draw; its calls now run with the session's random streams", self.engine.name)
                    self.random = True
                    self.engine.draws = "found_by_probe"
        if self.random:
            if rng_mod.LOCKLESS_DRAW_REPLAY and active_session_rng() is not None:
                # a replay loads the session's stream into the lane's generator state itself (no lock);
                # only an eager fallback installs the session's streams in the default generators
                self.engine.eager_context = drawing
                return self.engine(*args)
            with drawing():  # the engine replays a graph that draws under its backend's generator state
                return self.engine(*args)
        return self.engine(*args)


class RandomGuard(torch.nn.Module):
    """An eager partition that draws: it runs with the calling session's random streams installed."""

    def __init__(self, fn: torch.nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        with drawing():
            return self.fn(*args)


@dataclass
class RunnerSet:
    """Every runner of one optimized program, by partition and wrapped invocation."""

    gate: CaptureGate = field(default_factory=CaptureGate)
    engines: dict[str, ExactShapeReplay] = field(default_factory=dict)
    pool: object = None
    # the engines of one lane replay one at a time on one stream: their classes share staging memory
    arena: StagingArena = field(default_factory=StagingArena)

    def counters(self) -> dict[str, Any]:
        """Replays, eager fallbacks, rejections by reason, invalidations, captures (summed), and which
        wrapped callables draw (``drawing``: by why, the callables' names): each replay of one that draws
        runs with the calling session's random streams, under the draws' lock unless lock-free."""
        total: dict[str, Any] = {"replays": 0, "eager": 0, "invalidations": 0, "captures": 0, "rejections": {},
                                 "drawing": {}}
        for eng in self.engines.values():
            c = eng.counters
            for k in ("replays", "eager", "invalidations", "captures"):
                total[k] += getattr(c, k)
            for reason, n in c.rejections.items():
                total["rejections"][reason] = total["rejections"].get(reason, 0) + n
            if eng.draws:
                names = total["drawing"].setdefault(eng.draws, [])
                if eng.name not in names:
                    names.append(eng.name)
        return total

    @contextmanager
    def traffic_counters_paused(self) -> Iterator[None]:
        """Warm-up calls are not traffic: replays, eager calls and rejections made inside are not counted."""
        saved = {k: (e.counters.replays, e.counters.eager, Counter(e.counters.rejections))
                 for k, e in self.engines.items()}
        try:
            yield
        finally:
            for k, e in self.engines.items():
                e.counters.replays, e.counters.eager, e.counters.rejections = saved[k]

    def memory(self) -> dict[str, int]:
        reports = [r for e in self.engines.values() for r in e.classes.values()]
        return {"graph_pools": sum(r.graph_bytes for r in reports), "staging": sum(r.staging_bytes for r in reports)}


def install_runners(gm: GraphModule, backend: ReplayBackend, runners: RunnerSet,
                    verdicts: dict[str, dict[Any, ProbeVerdict]] | None = None) -> int:
    """Swap every annotated partition of ``gm`` for a replay runner; returns how many were installed.

    ``verdicts``: the probe findings of every lane's engines, by engine name (the same name on every
    lane of a program, since lanes install the same partitions in the same order): a lane after the
    first captures a class without probing it again (:class:`ExactShapeReplay`).
    """
    installed = 0
    for node in gm.graph.nodes:
        spec = replay_spec(node) if node.op == "call_module" else None
        if spec is None:
            continue
        if runners.pool is None:
            runners.pool = backend.new_pool()
        sub = getattr(gm, node.target)
        name = f"{len(runners.engines)}:{node.target}:{spec.name}"
        engine = ExactShapeReplay(sub, name=spec.name, aliased=spec.aliased, pool=runners.pool, backend=backend,
                                  readonly=spec.readonly, mutable=spec.written, arena=runners.arena,
                                  verdicts=None if verdicts is None else verdicts.setdefault(name, {}))
        setattr(gm, node.target, ReplayRunner(sub, engine, runners.gate, random=bool(node.meta.get(RANDOM))))
        runners.engines[name] = engine
        installed += 1
    return installed


def isolate_randomness(gm: GraphModule) -> int:
    """Make every draw that no replay runner owns use the calling session's streams; returns how many.

    A partition that draws and is not replayed gets a :class:`RandomGuard`; a random op left in the
    root graph (a step with no partitions) is routed through :func:`draw_random`.
    """
    guarded = retargeted = 0
    for node in list(gm.graph.nodes):
        if not node.meta.get(RANDOM):
            continue
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            if isinstance(sub, ReplayRunner):
                continue
            setattr(gm, str(node.target), RandomGuard(sub))
        elif node.op == "call_function" and node.target is not draw_random:
            node.args = (node.target, *node.args)
            node.target = draw_random
            retargeted += 1
        guarded += 1
    # the generated code calls submodules by attribute (a guard set above is found at call time): only
    # a retargeted call changes the code. A lane copy shares lane 0's graph, already retargeted, so it
    # regenerates nothing (a full code generation per program and lane otherwise)
    if retargeted:
        gm.recompile()
    return guarded
