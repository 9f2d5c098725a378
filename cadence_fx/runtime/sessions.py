"""Sessions: many conversations through one optimized program, each with its own state.

A session owns its region buffers (demand-sized, like the program's) and its random streams; the
weights, hoisted constants and captured graphs are the program's, shared. A call takes a free
lane (:mod:`cadence_fx.runtime.lanes`), copies the session's state inputs into the lane's buffers,
runs there, and copies the state outputs back into the session's buffers, which is what it returns.
So a call on a session computes exactly what the unmodified program computes from that session's
state, whatever ran on the lane before, and the bytes do not depend on which lane ran it.

The program's own calls (plain ``prog(...)``) are the default session. Its state stays in lane 0's
buffers between calls (no copies); a session that needs lane 0 first copies that state out.

A *pinned* session (``program.session(pin=True)``) takes a lane of its own for its life and keeps
its state in that lane's buffers, like the default session: a call copies no state in or out, and
its undo saves only what the call's writes overwrite (the journal:
:mod:`cadence_fx.runtime.journal`). Calls of other sessions never get a pinned lane. The state views
a pinned session returns are its lane's buffers: valid until its next call or its close.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar

import torch

from cadence_fx.binding import RegionSite
from cadence_fx.runtime.lanes import Entry, Lane, LanePool
from cadence_fx.runtime.rng import RngStates, SessionRng, session_rng
from cadence_fx.runtime.errors import StateMismatch
from cadence_fx.runtime.owners import resolve_source
from cadence_fx.runtime.state import copy_states, state_target, state_to
from cadence_fx.runtime.transaction import CallUndo, commit_copies, deferred_signals, whole_undo

_T = TypeVar("_T")


class SessionHost(Protocol):
    """What a session needs from the program that hands it out (the façade implements it)."""

    lanes: LanePool

    def new_region_buffers(self) -> dict[str, torch.Tensor]: ...
    def flatten_inputs(self, args: Sequence[Any], kwargs: dict[str, Any],
                       state: Mapping[str, torch.Tensor] | None = None) -> list[Any]: ...
    def visible_outputs(self, out: Any) -> Any: ...
    def lookup(self, flat: Sequence[Any]) -> tuple[tuple, Entry]: ...
    def check_entry(self, entry: Entry) -> None: ...
    def input_index(self, region: str) -> int: ...
    def region_sites(self) -> dict[str, RegionSite]: ...
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
                 rng: RngStates | None = None, lane: Lane | None = None) -> None:
        self.program = program
        self.name = name
        self.lane = lane  # the lane pinned to this session (its state lives there), or None
        self._buffers = program.new_region_buffers() if lane is None else dict(lane.state.region_buffers)
        states = rng if rng is not None else RngStates.seeded(seed) if seed is not None else RngStates.current()
        self.rng = SessionRng(states.clone())
        self._returned: dict[str, torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None  # end of the last call's work, on the stream that ran it
        self._lock = threading.Lock()
        self.calls = 0
        self.closed = False

    # ------------------------------------------------------------------ calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One call of the conversation. A call that raises (bad input, out of memory, an interrupt)
        leaves the session exactly as before it: its regions, its random streams, the state it
        accepts in place (:mod:`cadence_fx.runtime.transaction`)."""
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.name!r} is closed")
            flat = self.program.flatten_inputs(args, kwargs, self._returned)
            sources: dict[str, torch.Tensor] = {}
            key, entry = self.program.lookup(flat)
            asked: dict[int, set[int]] = {}  # each owner's last returned state, asked once for all regions
            for name, site in entry.sites.items():
                sources[name] = resolve_source(name, flat[self.program.input_index(name)], site.region.input, asked)
            rng_before = self.rng.states  # a draw replaces the states object, never changes it in place
            try:
                if self.lane is not None:
                    with self.program.lanes.take(self.lane.index) as lane:
                        out = self._run_pinned(lane, lane.catalog[key], flat, sources)
                else:
                    with self.program.lanes.take(prefer_unoccupied=True, key=key) as lane:
                        out = self._run_on(lane, lane.catalog[key], flat, sources)
            except BaseException:
                self.rng.states = rng_before
                raise
            self.calls += 1
            return self.program.visible_outputs(out)

    def _run_on(self, lane: Lane, entry: Entry, flat: list[Any], sources: dict[str, torch.Tensor]) -> Any:
        program = self.program
        program.check_entry(entry)
        cuda = any(b.is_cuda for b in self._buffers.values())
        with lane.on_stream(), torch.no_grad():
            program.evict(lane)  # on the lane's stream: after the default session's last call on it
            if self._done is not None:  # the session's previous call (any lane, any caller stream) came first
                torch.cuda.current_stream().wait_event(self._done)
            into, froms = [], []  # every region's copy in, then one operator for all of them
            for name, site in entry.sites.items():
                view, src = state_target(lane.state.region_buffer(name), name, sources[name], site)
                flat[program.input_index(name)] = view
                into.append(view)
                froms.append(src)
            copy_states(into, froms)
            with session_rng(self.rng):
                out = entry.gm(*flat)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            # everything that can fail comes before the commit: the session's buffers are untouched
            # until then, the lane's are scratch for this call
            state_outs, dsts, srcs, returned = set(), [], [], {}
            for name, site in entry.sites.items():
                j = site.output
                view, src = state_target(self._buffers[name], name, outs[j], site, layout=False)
                dsts.append(view)
                srcs.append(src)
                returned[name] = outs[j] = view
                state_outs.add(j)
            # an output that views what the lane writes (a workspace) would change under the next
            # session's call on this lane: the session gets its own copy
            for j, t in enumerate(outs):
                if j not in state_outs and isinstance(t, torch.Tensor) and lane.writes(t):
                    outs[j] = t.clone()
            done = torch.cuda.Event() if cuda else None
            with deferred_signals():  # the commit: one copy operator, then the record of it
                commit_copies(dsts, srcs)
                self._returned = returned
                if done is not None:
                    done.record()
                    self._done = done
        _to_caller(lane, outs)
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]

    def _run_pinned(self, lane: Lane, entry: Entry, flat: list[Any], sources: dict[str, torch.Tensor]) -> Any:
        """A call on the session's own lane: the state is already in the lane's buffers (the views the
        last call returned); a state given from elsewhere is copied in first. The call writes the
        state in place; if it raises, the undo puts back what it overwrote."""
        program = self.program
        program.check_entry(entry)
        # a state fed as another region's input lives in that region's buffer here: copied first
        sources = lane.state.stage_crossed(sources)
        with lane.on_stream(), torch.no_grad():
            into, froms, copied = [], [], set()
            for name, site in entry.sites.items():
                view, src = state_target(lane.state.region_buffer(name), name, sources[name], site)
                flat[program.input_index(name)] = view
                if not _same_view(view, src):
                    into.append(view)
                    froms.append(src)
                    copied.add(name)
            undo = CallUndo(entry.gm, entry.facts.journal, whole_undo(entry.facts.journal, self._returned, copied))
            try:
                copy_states(into, froms)
                undo.inputs = {name: flat[program.input_index(name)] for name in entry.sites}
                undo.buffers = lane.state.region_buffers
                with session_rng(self.rng):
                    out = entry.gm(*flat)
                outs = list(out) if isinstance(out, (tuple, list)) else [out]
                returned = {name: outs[site.output] for name, site in entry.sites.items()}
            except BaseException:
                undo.rollback()
                raise
            self._returned = returned
        _to_caller(lane, outs)
        return out

    # ------------------------------------------------------------------ what the program asks
    def last_returned(self) -> dict[str, torch.Tensor]:
        return dict(self._returned)

    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor:
        return returned

    def buffers(self) -> list[torch.Tensor]:
        """The session's own region buffers (empty once closed)."""
        return list(self._buffers.values())

    # ------------------------------------------------------------------ turn boundaries
    def read_state(self, reader: Callable[[Mapping[str, torch.Tensor]], _T]) -> tuple[_T, RngStates]:
        """``reader`` applied to the session's current state (views of its own buffers, by region
        name: read them inside ``reader``, they change with the next call) and a clone of its random
        streams, under the session's lock: a snapshot that copies the state its own way (packed into
        one buffer, :mod:`cadence_fx.serve.packing`) instead of one clone per region."""
        with self._lock:
            self._check_open()
            return reader(dict(self._returned)), self.rng.states.clone()

    def snapshot(self, device: torch.device | str | None = None) -> Snapshot:
        """The session's current state (clones, on ``device`` or where it lives) and random streams."""
        with self._lock:
            self._check_open()
            state = {n: state_to(t, device) if device is not None else t.clone() for n, t in self._returned.items()}
            return Snapshot(state, self.rng.states.clone())

    def restore(self, snapshot: Snapshot) -> dict[str, torch.Tensor]:
        """Put the session back to ``snapshot``; returns the state to feed to the next call (by region name).

        The snapshot is checked whole before anything is written (its regions are this program's, each
        of the region's dtype and shape: :class:`StateMismatch` otherwise), then copied in as one
        operator: a restore that raises leaves the session as it was."""
        with self._lock:
            self._check_open()
            if not isinstance(snapshot, Snapshot):
                raise TypeError(f"restore takes a Snapshot (from Session.snapshot), got {type(snapshot).__name__}")
            sites = self.program.region_sites()
            unknown = sorted(set(snapshot.state) - set(sites))
            if unknown:
                raise StateMismatch(f"session {self.name!r}: the snapshot holds region(s) {unknown}, which this "
                                    f"program does not have (its regions: {sorted(sites)}); a snapshot of another "
                                    f"model or contract")
            targets = {}
            for name, t in snapshot.state.items():
                if not isinstance(t, torch.Tensor):
                    raise StateMismatch(f"session {self.name!r}: region {name!r} of the snapshot is a "
                                        f"{type(t).__name__}, not a tensor")
                targets[name] = state_target(self._buffers[name], name, t, sites[name], layout=self.lane is not None)
            rng = snapshot.rng.clone() if snapshot.rng is not None else None
            with self._on_own_lane(), deferred_signals():
                commit_copies([v for v, _ in targets.values()], [src for _, src in targets.values()])
                self._returned = {name: v for name, (v, _) in targets.items()}
                if rng is not None:
                    self.rng.states = rng
            return dict(self._returned)

    @contextmanager
    def _on_own_lane(self) -> Iterator[None]:
        """For a pinned session: hold its lane and run on its stream (what writes the lane's buffers)."""
        if self.lane is None:
            yield
            return
        with self.program.lanes.take(self.lane.index) as lane, lane.on_stream():
            yield

    def close(self) -> None:
        """Release the session: later calls raise :class:`SessionClosed`. Its buffers are freed once
        no view of them is left: a state view the caller still holds keeps its bytes (memory is never
        freed under a live tensor)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.program.forget_session(self)
            self._returned = {}
            self._buffers = {}
            self.lane = None

    def nbytes(self) -> int:
        """Device bytes this session's state takes (its region buffers; a pinned session's are its lane's)."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed(f"session {self.name!r} is closed")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_caller(lane: Lane, outs: Sequence[Any]) -> None:
    """Outputs allocated on the lane's stream are read on the caller's: their memory waits for it."""
    if lane.stream is None:
        return
    caller = torch.cuda.current_stream(lane.stream.device)
    for t in outs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            t.record_stream(caller)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is the very bytes ``a`` views (the state a pinned session's last call returned)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
