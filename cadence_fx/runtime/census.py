"""What an optimized program holds and has done, read off its lanes: the census behind its report methods.

The replay engines and their counters (summed over lanes), the bytes the program holds on its device
by kind, and the module tensors its programs write in place that the contract does not own
(:meth:`Census.undeclared_state`): state that every caller of the program would share.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch

from cadence_fx.annotations import is_journal_attr

from cadence_fx.analysis.graph_io import fetch_attr
from cadence_fx.runtime.lanes import Lane, LanePool, lane_writes

__all__ = ["Census"]


class _Sized(Protocol):
    def nbytes(self) -> int: ...


class Census:
    """The report methods of one program over its lanes (built once the lanes are)."""

    def __init__(self, lanes: LanePool) -> None:
        self.lanes = lanes
        self._writes_by_lane: dict[int, dict[str, tuple[torch.Tensor, bool]]] = {}

    def runners(self) -> dict[str, Any]:
        """All replay engines, by lane (after the first), partition and wrapped invocation."""
        out = {}
        for lane in self.lanes.lanes:
            prefix = f"lane{lane.index}/" if lane.index else ""
            out.update({prefix + k: e for k, e in lane.runners.engines.items()})
        return out

    def counters(self) -> dict[str, Any]:
        """Replays, eager fallbacks, rejections by reason, invalidations, captures (summed over runners
        and lanes). Warm-up is not traffic: only its captures are counted."""
        total: dict[str, Any] = {"replays": 0, "eager": 0, "invalidations": 0, "captures": 0, "rejections": {},
                                 "drawing": {}}
        for lane in self.lanes.lanes:
            c = lane.runners.counters()
            for k in ("replays", "eager", "invalidations", "captures"):
                total[k] += c[k]
            for reason, n in c["rejections"].items():
                total["rejections"][reason] = total["rejections"].get(reason, 0) + n
            for why, names in c["drawing"].items():
                mine = total["drawing"].setdefault(why, [])
                mine.extend(x for x in names if x not in mine)
        return total

    def memory(self, sessions: Iterable[_Sized]) -> dict[str, int]:
        """Bytes the program holds on its device, by kind: parameters, constants (buffers and hoisted
        constants), regions, workspaces, graph pools (reserved by captures), staging buffers (all
        lanes), the undo journals' buffers, and the open ``sessions``' own region buffers (a pinned
        session's are its lane's regions)."""
        owned = frozenset().union(*(lane.state.owned_storages() for lane in self.lanes.lanes))
        seen: dict[int, tuple[str, int]] = {}
        for gm in [e.gm for lane in self.lanes.lanes for e in lane.catalog.values()]:
            for kind, tensors in (("parameters", gm.named_parameters()), ("constants", gm.named_buffers())):
                for name, t in tensors:
                    st = t.untyped_storage()
                    if st.data_ptr() not in owned:
                        seen.setdefault(st.data_ptr(), ("journal" if is_journal_attr(name) else kind, st.nbytes()))
        out = {"parameters": 0, "constants": 0, "journal": 0}
        for kind, nbytes in seen.values():
            out[kind] += nbytes
        for lane in self.lanes.lanes:
            for part in (lane.state.nbytes(), lane.runners.memory()):
                for k, v in part.items():
                    out[k] = out.get(k, 0) + v
        # a pinned session's state is its lane's regions, counted above
        out["sessions"] = sum(s.nbytes() for s in sessions if getattr(s, "lane", None) is None)
        return out

    def undeclared_state(self, lane: Lane | None = None) -> dict[str, torch.Tensor]:
        """Module tensors the programs write in place and read back in a later call that the contract
        does not own (neither a region nor a workspace), by attribute name: state every caller of the
        program shares (lane 0's programs, or ``lane``'s). Scratch the step writes before it reads
        (the solver's per-step cache buffer) is not state and is not listed."""
        return {name: t for name, (t, carried) in self.module_writes(lane).items() if carried}

    def module_writes(self, lane: Lane | None = None) -> dict[str, tuple[torch.Tensor, bool]]:
        """``{attribute: (tensor, carried)}`` of :func:`attribute_writes` over the lane's programs, less
        what the lane owns; worked out once per lane (the programs do not change after they are built)."""
        lane = lane if lane is not None else self.lanes.lanes[0]
        if lane.index in self._writes_by_lane:
            return self._writes_by_lane[lane.index]
        owned = lane.state.owned_storages()
        out: dict[str, tuple[torch.Tensor, bool]] = {}
        seen: dict[int, str] = {}
        for entry in lane.catalog.values():
            for target, carried in sorted(lane_writes(entry.gm).items()):
                value = fetch_attr(entry.gm, target)
                if not isinstance(value, torch.Tensor) or value.untyped_storage().data_ptr() in owned:
                    continue
                name = seen.setdefault(id(value), target)
                out[name] = (value, carried or out.get(name, (value, False))[1])
        self._writes_by_lane[lane.index] = out
        return out
