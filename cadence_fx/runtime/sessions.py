"""Sessions: many conversations through one optimized program, each with its own state.

A session owns its region buffers (demand-sized, like the program's) and its random streams; the
weights, hoisted constants and captured graphs are the program's, shared. A call takes a free
lane (:mod:`cadence_fx.runtime.lanes`), copies the session's state inputs into the lane's buffers,
runs there, and copies the state outputs back into the session's buffers, which is what it returns.
So a call on a session computes exactly what the unmodified program computes from that session's
state, whatever ran on the lane before, and the bytes do not depend on which lane ran it.

The program's own calls (plain ``prog(...)``) are the default session. Its state stays in lane 0's
buffers between calls (no copies); a session that needs lane 0 first copies that state out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import torch

from cadence_fx.binding import RegionSite
from cadence_fx.runtime.lanes import Entry, Lane, LanePool
from cadence_fx.runtime.rng import RngStates, SessionRng, session_rng
from cadence_fx.runtime.state import StaleState, copy_into, stale_message, state_to

class SessionHost(Protocol):
    """What a session needs from the program that hands it out (the façade implements it)."""

    lanes: LanePool

    def new_region_buffers(self) -> dict[str, torch.Tensor]: ...
    def flatten_inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]: ...
    def lookup(self, flat: Sequence[Any]) -> tuple[tuple, Entry]: ...
    def check_entry(self, entry: Entry) -> None: ...
    def input_index(self, region: str) -> int: ...
    def region_sites(self) -> dict[str, RegionSite]: ...
    def owner_of(self, t: torch.Tensor) -> Any: ...
    def evict(self, lane: Lane) -> None: ...
    def forget_session(self, session: "Session") -> None: ...

__all__ = ["Session", "SessionClosed", "SessionHost", "Snapshot"]


class SessionClosed(RuntimeError):
    """A call, snapshot or restore on a session that was closed."""


@dataclass(frozen=True)
class Snapshot:
    """A session's state at a turn boundary: each region's tensor (cloned) and its random streams."""

    state: Mapping[str, torch.Tensor]
    rng: RngStates | None


class Session:
    """One conversation through an optimized program. Call it like the program.

    Feed back the state each call returns (views of the session's own buffers, valid until the
    session's next call), or any other tensor (copied in). A view of a session buffer other than the
    last returned state is refused with :class:`~cadence_fx.runtime.state.StaleState`.
    """

    def __init__(self, program: SessionHost, name: str, *, seed: int | None = None,
                 rng: RngStates | None = None) -> None:
        self.program = program
        self.name = name
        self._buffers = program.new_region_buffers()
        states = rng if rng is not None else RngStates.seeded(seed) if seed is not None else RngStates.current()
        self.rng = SessionRng(states.clone())
        self._returned: dict[str, torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None  # end of the last call's work, on the stream that ran it
        self._lock = threading.Lock()
        self.calls = 0
        self.closed = False

    # ------------------------------------------------------------------ calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.name!r} is closed")
            flat = self.program.flatten_inputs(args, kwargs)
            sources: dict[str, torch.Tensor] = {}
            key, entry = self.program.lookup(flat)
            for name, site in entry.sites.items():
                sources[name] = self._source(name, flat[self.program.input_index(name)], site)
            with self.program.lanes.take(prefer_unoccupied=True) as lane:
                out = self._run_on(lane, lane.catalog[key], flat, sources)
            self.calls += 1
            return out

    def _run_on(self, lane: Lane, entry: Entry, flat: list[Any], sources: dict[str, torch.Tensor]) -> Any:
        program = self.program
        program.check_entry(entry)
        cuda = any(b.is_cuda for b in self._buffers.values())
        with lane.on_stream(), torch.no_grad():
            program.evict(lane)  # on the lane's stream: after the default session's last call on it
            if self._done is not None:  # the session's previous call (any lane, any caller stream) came first
                torch.cuda.current_stream().wait_event(self._done)
            for name, site in entry.sites.items():
                flat[program.input_index(name)] = copy_into(lane.state.region_buffer(name), name, sources[name], site)
            with session_rng(self.rng):
                out = entry.gm(*flat)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            state_outs = set()
            for name, site in entry.sites.items():
                j = site.region.output
                outs[j] = copy_into(self._buffers[name], name, outs[j], site, layout=False)
                self._returned[name] = outs[j]
                state_outs.add(j)
            # an output that views what the lane writes (a workspace) would change under the next
            # session's call on this lane: the session gets its own copy
            for j, t in enumerate(outs):
                if j not in state_outs and isinstance(t, torch.Tensor) and lane.writes(t):
                    outs[j] = t.clone()
            if cuda:
                self._done = torch.cuda.Event()
                self._done.record()
        if lane.stream is not None:  # outputs allocated on the lane's stream are read on the caller's
            caller = torch.cuda.current_stream(lane.stream.device)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(caller)
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]

    def _source(self, name: str, arg: Any, site: RegionSite) -> torch.Tensor:
        """Where a state input's bytes are: checked against every buffer the program's sessions own."""
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"region {name!r}: expected a tensor for input {site.region.input!r}, got {type(arg)}")
        owner = self.program.owner_of(arg)
        if owner is None:
            return arg  # a foreign tensor: a prompt's state, a snapshot, a clone
        if any(arg is t for t in owner.last_returned().values()):
            return owner.current_bytes(arg)  # the current state of this session or another: copied in
        raise StaleState(stale_message(name, site.region.input))

    # ------------------------------------------------------------------ what the program asks
    def last_returned(self) -> dict[str, torch.Tensor]:
        return dict(self._returned)

    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor:
        return returned

    def storages(self) -> list[int]:
        return [b.untyped_storage().data_ptr() for b in self._buffers.values()]

    # ------------------------------------------------------------------ turn boundaries
    def snapshot(self, device: torch.device | str | None = None) -> Snapshot:
        """The session's current state (clones, on ``device`` or where it lives) and random streams."""
        with self._lock:
            self._check_open()
            state = {n: state_to(t, device) if device is not None else t.clone() for n, t in self._returned.items()}
            return Snapshot(state, self.rng.states.clone())

    def restore(self, snapshot: Snapshot) -> dict[str, torch.Tensor]:
        """Put the session back to ``snapshot``; returns the state to feed to the next call (by region name)."""
        with self._lock:
            self._check_open()
            sites = self.program.region_sites()
            for name, t in snapshot.state.items():
                self._returned[name] = copy_into(self._buffers[name], name, t, sites[name], layout=False)
            if snapshot.rng is not None:
                self.rng.states = snapshot.rng.clone()
            return dict(self._returned)

    def close(self) -> None:
        """Release the session's buffers; later calls raise :class:`SessionClosed`."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.program.forget_session(self)
            self._returned.clear()
            for b in self._buffers.values():
                b.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        """Device bytes this session holds (its region buffers)."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed(f"session {self.name!r} is closed")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
