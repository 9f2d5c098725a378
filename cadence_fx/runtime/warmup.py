"""Warm-up: capture every catalog class on every lane before traffic, leaving all state as found, or
the first lanes before traffic and the others beside it (:class:`LaneWarmup`).

One call per exported program runs with region inputs of that program's extents; the other inputs
come from the caller's examples where their shapes fit and are zeros otherwise (values do not matter
for capture, shapes do). The regions, workspaces and the module tensors the programs write are put
back afterwards, and the program's call counters are not moved.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from contextlib import nullcontext
from typing import Any, Mapping, Sequence

import torch

from cadence_fx.progress import Progress
from cadence_fx.runtime.backends import CAPTURE_STREAM_PRIORITIES, beside_traffic
from cadence_fx.runtime.census import Census
from cadence_fx.runtime.lanes import Entry, Lane, LanePool
from cadence_fx.runtime.rng import draws_held
from cadence_fx.runtime.streams import held_stream

__all__ = ["BESIDE_ON_CUDA_ENV", "LaneWarmup", "beside_traffic_on_cuda", "warm_lane", "warm_up", "warmup_args",
           "written_buffers"]

log = logging.getLogger(__name__)


def warm_up(lanes: LanePool, census: Census, example_args: Sequence[Any], *, region_index: Mapping[str, int],
            state_rule: bool, stats: dict[str, Any], only: Sequence[Lane] | None = None,
            full_lanes: int | None = None, steady: Sequence[int] = (-1,)) -> dict[str, Any]:
    """Capture every catalog class of every lane of ``lanes`` (or of the lanes ``only``); ``stats`` (the
    program's counters) is left as found. Returns the warm-up seconds and per-class reports.

    ``full_lanes``: only the lanes numbered below it capture every class; the others capture the
    ``steady`` classes alone (positions in the catalog's export order, negative from its end: the
    class a stream stays in once its caches are full is the last of a chunk clock's catalog), and
    calls of another class are handed only lanes that have it (:attr:`Lane.classes`). A worker is
    then ready after one full lane and the steady class of the others; what each call computes is
    unchanged (the same graph of a class on whichever lane runs it)."""
    t0 = time.perf_counter()
    kept = {k: v for k, v in stats.items() if isinstance(v, int)}
    chosen = list(lanes.lanes if only is None else only)
    plan = {lane.index: _lane_classes(lane, full_lanes, steady) for lane in chosen}
    bar = Progress("cadence_fx capture", sum(len(plan[lane.index] or lane.catalog) for lane in chosen))
    for lane in chosen:
        warm_lane(lanes, lane, example_args, census=census, region_index=region_index, state_rule=state_rule, bar=bar,
                  classes=plan[lane.index])
        lane.classes = plan[lane.index]
    bar.close()
    stats.update(kept)
    return {"seconds": time.perf_counter() - t0,
            "classes": {name: dict(eng.classes) for name, eng in census.runners().items()}}


def _lane_classes(lane: Lane, full_lanes: int | None, steady: Sequence[int]) -> frozenset | None:
    """The classes ``lane`` captures under ``full_lanes``/``steady`` (None: all of them)."""
    if full_lanes is None or lane.index < max(1, full_lanes):  # lane 0 serves the default session: every class
        return None
    keys = list(lane.catalog)
    try:
        picked = frozenset(keys[i] for i in steady)
    except IndexError:
        raise ValueError(f"steady={list(steady)}: the catalog has {len(keys)} class(es)") from None
    return None if len(picked) == len(keys) else picked


def warm_lane(lanes: LanePool, lane: Lane, example_args: Sequence[Any], *, census: Census,
              region_index: Mapping[str, int], state_rule: bool, bar: Progress | None = None,
              beside: bool = False, classes: frozenset | None = None) -> None:
    """Capture every catalog class of ``lane`` (or the ``classes`` among them), leaving its state as
    found. ``beside``: other threads are serving on other lanes meanwhile; each class then runs with
    every draw of the process held
    (:func:`~cadence_fx.runtime.rng.draws_held`: a capture rewinds the default generators, which a
    session's call may have its streams installed in), and the lane's work is finished on the device
    before this returns (its state is put back on this thread's stream, which no later call of the
    lane waits for)."""
    with lanes.take(lane.index), lane.state.preserved(written_buffers(census, lane)) as restored, \
            lane.runners.traffic_counters_paused(), lane.runners.gate.open(restored), \
            lane.on_stream(), torch.no_grad():
        # the largest classes first: the lane's engines stage into one arena, which then
        # never has to grow for a later class (a grown arena keeps the old one alive)
        chosen = [(k, e) for k, e in lane.catalog.items() if classes is None or k in classes]
        for key, entry in sorted(chosen, key=lambda kv: -_input_bytes(kv[0])):
            flat = warmup_args(lane, key, entry, example_args, region_index=region_index, state_rule=state_rule)
            with draws_held() if beside else nullcontext():
                if state_rule:
                    for name, site in entry.sites.items():
                        i = region_index[name]
                        flat[i] = lane.state.adopt(name, flat[i], site)
                entry.gm(*flat)
            if bar is not None:
                bar.advance(note=f"lane {lane.index}")
    if lane.stream is not None:
        torch.cuda.current_stream(lane.stream.device).wait_stream(lane.stream)
    if beside and lane.stream is not None:
        torch.cuda.current_stream(lane.stream.device).synchronize()


#: Set to 1 to capture CUDA lanes beside traffic anyway (to measure it; not proven exact yet).
BESIDE_ON_CUDA_ENV = "CADENCE_FX_CAPTURE_BESIDE_TRAFFIC"


def beside_traffic_on_cuda() -> bool:
    """Whether CUDA lanes are captured beside traffic (``CADENCE_FX_CAPTURE_BESIDE_TRAFFIC=1``)."""
    return os.environ.get(BESIDE_ON_CUDA_ENV, "") == "1"


class LaneWarmup:
    """Lanes captured on a background thread while the first ones serve (:meth:`OptimizedProgram.warmup_in_background`).

    The lanes after the first ``first`` are held offline (no session call gets them), captured one by one
    beside traffic (:func:`~cadence_fx.runtime.backends.beside_traffic`), and each is brought online once
    its classes are captured and its state is back. A lane whose warm-up raises stays offline; the
    error is kept (:attr:`error`) and raised by :meth:`wait`, and the lanes already online keep serving.

    Lanes of CUDA graphs are captured before traffic (all of them, before this returns: :attr:`beside`
    is then False) unless :data:`BESIDE_ON_CUDA_ENV` is set: captured beside traffic on the H200, a
    test's sessions gave other bytes than their solo runs (session 20), cause not yet found.
    """

    def __init__(self, lanes: LanePool, census: Census, example_args: Sequence[Any], *, first: int,
                 region_index: Mapping[str, int], state_rule: bool, stats: dict[str, Any]) -> None:
        if not 1 <= first <= len(lanes.lanes):
            raise ValueError(f"first must be in 1..{len(lanes.lanes)} (the program's lanes), got {first}")
        self._lanes, self._census, self._example = lanes, census, tuple(example_args)
        self._region_index, self._state_rule = region_index, state_rule
        # fail closed where it is not proven: lanes of CUDA graphs captured beside traffic gave other
        # bytes on the H200 (docs/benchmarks.md, session 20), so they are captured before traffic there
        self.beside = not any(ln.stream is not None for ln in lanes.lanes) or beside_traffic_on_cuda()
        if not self.beside:
            log.warning("lanes of CUDA graphs are captured before traffic, not beside it: captures beside "
                        "traffic are not yet proven exact on the GPU (set %s=1 to try them)", BESIDE_ON_CUDA_ENV)
            first = len(lanes.lanes)
        self._pending = list(lanes.lanes[first:])
        self.error: BaseException | None = None
        self.lane_seconds: dict[int, float] = {}
        self._done = threading.Event()
        t0 = time.perf_counter()
        lanes.hold_offline(ln.index for ln in self._pending)
        self.report = warm_up(lanes, census, self._example, stats=stats, only=lanes.lanes[:first],
                              region_index=region_index, state_rule=state_rule)
        self.first_seconds = time.perf_counter() - t0
        self.seconds: float | None = None  # from the start to every lane online (None until then)
        self.started = t0  # time.perf_counter() at the start
        if not self._pending:
            self.seconds = self.first_seconds
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, name="cadence_fx-lane-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        device = self._pending[0].stream.device if self._pending[0].stream is not None else None
        try:
            # this thread's own stream, held: a pooled one may be a serving thread's, which the lane's
            # restore copies would then hold up
            with beside_traffic(), torch.cuda.stream(held_stream(device, CAPTURE_STREAM_PRIORITIES, self)) \
                    if device is not None else nullcontext():
                for lane in self._pending:
                    t = time.perf_counter()
                    warm_lane(self._lanes, lane, self._example, census=self._census, region_index=self._region_index,
                              state_rule=self._state_rule, beside=True)
                    self.lane_seconds[lane.index] = time.perf_counter() - t
                    self._lanes.bring_online(lane.index)
                    log.info("lane %d online after %.2f s of capture beside traffic", lane.index,
                             self.lane_seconds[lane.index])
            self.seconds = time.perf_counter() - self.started
        except BaseException as exc:  # the lanes online keep serving; the error is the caller's to see
            self.error = exc
            log.exception("warm-up beside traffic failed; lanes %s stay offline",
                          [ln.index for ln in self._pending if ln.index not in self.lane_seconds])
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def online(self) -> int:
        """Lanes serving now."""
        return self._lanes.online()

    def wait(self, timeout: float | None = None) -> "LaneWarmup":
        """Block until every lane is online. Raises :class:`TimeoutError` after ``timeout`` seconds, and
        :class:`RuntimeError` (from the warm-up's error) when a lane's capture failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"lanes still capturing after {timeout} s ({self.online()} of "
                               f"{len(self._lanes.lanes)} online)")
        if self.error is not None:
            raise RuntimeError(f"warm-up beside traffic failed ({self.online()} of {len(self._lanes.lanes)} "
                               f"lanes online): {self.error!r}") from self.error
        return self


def written_buffers(census: Census, lane: Lane) -> list[torch.Tensor]:
    """Module tensors the lane's programs write in place besides its regions and workspaces (a
    step's own call counter, a scratch buffer): warm-up runs the programs, so it puts these back."""
    return [t for t, _carried in census.module_writes(lane).values()]


def warmup_args(lane: Lane, key: tuple, entry: Entry, example_args: Sequence[Any], *,
                region_index: Mapping[str, int], state_rule: bool) -> list[Any]:
    """The inputs warm-up calls ``entry`` of ``lane`` with (catalog key ``key``)."""
    regions = {region_index[name]: name for name in entry.sites} if state_rule else {}
    device = next((t.device for t in lane.state.region_buffers.values()), None)
    # an input with no example is made where the exported program expects it (without the state
    # rule there are no region buffers to go by, and a state made on the host would be captured)
    recorded = [n.meta.get("val") for n in entry.gm.graph.nodes if n.op == "placeholder"]
    flat: list[Any] = []
    for i, want in enumerate(key):
        if i in regions:  # a view of the region buffer: allocate nothing
            site = entry.sites[regions[i]]
            flat.append(lane.state.trusted_view(regions[i], site))
            continue
        ex = example_args[i] if i < len(example_args) else None
        if want[0] == "T" and (not isinstance(ex, torch.Tensor) or (tuple(ex.shape), ex.dtype) != want[1:]):
            val = recorded[i] if i < len(recorded) else None
            dev = ex.device if isinstance(ex, torch.Tensor) else \
                val.device if isinstance(val, torch.Tensor) else device or "cpu"
            ex = torch.zeros(want[1], dtype=want[2], device=dev)
        elif want[0] == "S" and len(want) == 3:
            ex = want[2]
        flat.append(ex)
    return flat


def _input_bytes(key: tuple) -> int:
    """Bytes of the tensor inputs a catalog key describes (symbolic sizes count as 0)."""
    total = 0
    for k in key:
        if k[0] == "T" and all(isinstance(n, int) for n in k[1]):
            total += math.prod(k[1]) * k[2].itemsize
    return total
