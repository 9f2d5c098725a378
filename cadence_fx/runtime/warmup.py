"""Warm-up: capture every catalog class on every lane before traffic, leaving all state as found.

One call per exported program runs with region inputs of that program's extents; the other inputs
come from the caller's examples where their shapes fit and are zeros otherwise (values do not matter
for capture, shapes do). The regions, workspaces and the module tensors the programs write are put
back afterwards, and the program's call counters are not moved.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

import torch

from cadence_fx.progress import Progress
from cadence_fx.runtime.census import Census
from cadence_fx.runtime.lanes import Entry, Lane, LanePool

__all__ = ["warm_up", "warmup_args", "written_buffers"]


def warm_up(lanes: LanePool, census: Census, example_args: Sequence[Any], *, region_index: Mapping[str, int],
            state_rule: bool, stats: dict[str, Any]) -> dict[str, Any]:
    """Capture every catalog class of every lane of ``lanes``; ``stats`` (the program's counters) is
    left as found. Returns the warm-up seconds and per-class reports."""
    t0 = time.perf_counter()
    kept = {k: v for k, v in stats.items() if isinstance(v, int)}
    bar = Progress("cadence_fx capture", sum(len(lane.catalog) for lane in lanes.lanes))
    for lane in lanes.lanes:
        with lanes.take(lane.index), lane.state.preserved(written_buffers(census, lane)) as restored, \
                lane.runners.traffic_counters_paused(), lane.runners.gate.open(restored), \
                lane.on_stream(), torch.no_grad():
            # the largest classes first: the lane's engines stage into one arena, which then
            # never has to grow for a later class (a grown arena keeps the old one alive)
            for key, entry in sorted(lane.catalog.items(), key=lambda kv: -_input_bytes(kv[0])):
                flat = warmup_args(lane, key, entry, example_args, region_index=region_index, state_rule=state_rule)
                if state_rule:
                    for name, site in entry.sites.items():
                        i = region_index[name]
                        flat[i] = lane.state.adopt(name, flat[i], site)
                entry.gm(*flat)
                bar.advance(note=f"lane {lane.index}")
        if lane.stream is not None:
            torch.cuda.current_stream(lane.stream.device).wait_stream(lane.stream)
    bar.close()
    stats.update(kept)
    return {"seconds": time.perf_counter() - t0,
            "classes": {name: dict(eng.classes) for name, eng in census.runners().items()}}


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
