"""``cadence_fx.optimize``: the drop-in replacement for ``exported_program.module()``.

The façade over the lanes, the session host and the census. :class:`OptimizedProgram` is built from a
program source (:mod:`cadence_fx.build`): :func:`optimize` hands it a :class:`~cadence_fx.build.PassesSource`
(the pass pipeline over the exported programs), :func:`cadence_fx.load` an artifact's source. The
façade keeps the default session's call path (a transaction: :mod:`cadence_fx.runtime.transaction`)
and hosts the sessions (:mod:`cadence_fx.runtime.sessions`); warm-up and the census live apart.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from cadence_fx.binding import RegionSite
from cadence_fx.build import LaneBuilder, PassesSource, ProgramSource, Replay, check_lanes, envelope_sites, pick_backend
from cadence_fx.contract import Contract, ContractError
from cadence_fx.analysis.graph_io import numel
from cadence_fx.runtime import owners
from cadence_fx.runtime.owners import DefaultState, NoReturned
from cadence_fx.runtime.catalog import CatalogMiss
from cadence_fx.runtime.census import Census
from cadence_fx.runtime.lanes import Entry, Lane
from cadence_fx.runtime.rng import RngStates
from cadence_fx.runtime.sessions import Session
from cadence_fx.runtime.transaction import CallUndo, whole_undo
from cadence_fx.runtime.warmup import LaneWarmup, warm_up
from cadence_fx.runtime.weights import FoldedWeights

__all__ = ["CatalogMiss", "OptimizedProgram", "Replay", "check_lanes", "optimize"]


class OptimizedProgram:
    """Callable like ``exported_program.module()``; owns the region buffers and the replay runners.

    Outputs that are not state regions are bit-identical to the unmodified program on every call.
    State outputs are views of contract-owned buffers that the next call overwrites: feed the state a
    call returns back as it is (used in place), or any other tensor (a snapshot restored at a turn
    boundary) to be copied in. A view of an older call's state is refused (:class:`cadence_fx.StaleState`).

    Many conversations: :meth:`session` hands out sessions with state of their own over the same
    weights and graphs; ``optimize(..., lanes=n)`` builds n graph sets that run session calls at once.
    """
    load_report: dict[str, float]  # where cadence_fx.load spent its time (a loaded program only)

    def __init__(self, source: ProgramSource, *, replay: Replay | Any = "auto", lanes: int = 1,
                 transactional: bool = True) -> None:
        """Build the lanes from ``source`` (:mod:`cadence_fx.build`): :func:`optimize` and
        :func:`cadence_fx.load` are the ways in."""
        check_lanes(lanes)
        self.contract: Contract = source.contract
        self.state_rule = source.state_rule
        self.transactional = transactional
        self.shared_bytes = source.shared_bytes
        self.plan = source.plan
        self.auditor = source.auditor
        self._names = list(source.names)
        # regions kept in module buffers: the program feeds those inputs itself and drops those outputs
        self.buffer_regions = source.buffer_regions
        self._visible = list(self.buffer_regions.visible_names) if self.buffer_regions else self._names
        self._region_index = {r.name: self._names.index(r.input) for r in self.contract.regions}
        backend = pick_backend(replay, lanes)
        self._sites = envelope_sites(self.plan, source.sites, self.state_rule)
        self._stats: dict[str, Any] = {"calls": 0, "not_admitted": 0, "passes": {}}
        # held weakly: a session dropped without close() is reclaimed with its buffers
        self._sessions: "weakref.WeakValueDictionary[int, Session]" = weakref.WeakValueDictionary()
        self._lane_owner = NoReturned()  # lanes after the first: no state is ever returned from them
        self._session_lock = threading.Lock()
        self._session_count = 0
        builder = LaneBuilder(source, sites=self._sites, region_index=self._region_index, backend=backend)
        self.lanes = builder.build(lanes)
        self._stats["passes"] = builder.passes
        lane0 = self.lanes.lanes[0]
        self._default = DefaultState(lane0)
        lane0.resident = self._default
        for lane in self.lanes.lanes:
            owners.register(self._default if lane.index == 0 else self._lane_owner, lane.state.tensors())
        self.state = lane0.state
        self.catalog = lane0.catalog
        self.census = Census(self.lanes)

    @property
    def program_input_names(self) -> list[str]:
        """The rewritten programs' inputs, in calling order: :attr:`input_names` plus the regions kept in
        module buffers, which the program feeds itself (what an artifact stores)."""
        return list(self._names)

    @property
    def input_names(self) -> list[str]:
        """The program's inputs, in calling order (the exported programs' user inputs; a region kept in a
        module buffer is not one: the program holds it)."""
        return list(self._visible)

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One call of the default session (lane 0, state kept in place between calls).

        A call that raises leaves the state as before it: the regions' bytes, the state the next call
        accepts in place, the random generators (:class:`cadence_fx.runtime.transaction.UndoLog`;
        ``optimize(..., transactional=False)`` skips the copy, and a call that raises then leaves the
        regions undefined: feed the next call a state of your own)."""
        flat = self.flatten_inputs(args, kwargs, self._default.returned)
        with self.lanes.take(0) as lane, lane.on_stream():  # after a session's call on lane 0 from another stream
            entry = lane.catalog.lookup(flat)
            self.check_entry(entry)
            evicted = lane.resident is not self._default  # a session used lane 0 since: our state was copied out
            returned = lane.state.last_returned()
            undo = CallUndo(entry.gm, entry.facts.journal, self._undo_views(lane, entry, flat)) \
                if self.transactional and not evicted else None
            rng = RngStates.current() if entry.draws_randomness() else None
            try:
                out = self._call_default(lane, entry, flat, evicted, undo)
            except BaseException:
                if undo is not None:
                    undo.rollback()
                lane.state.set_returned(returned)
                if rng is not None:
                    rng.install()
                raise
            if evicted:
                lane.resident = self._default
                self._default.evicted = {}
            if self.state_rule:
                self._default.returned = lane.state.last_returned()
            return self.visible_outputs(out)

    def _call_default(self, lane: Lane, entry: Entry, flat: list[Any], evicted: bool,
                      undo: CallUndo | None = None) -> Any:
        if evicted:
            for name, t in self._default.returned.items():
                i = self._region_index[name]
                if flat[i] is t:
                    flat[i] = self._default.evicted.get(name, t)
            lane.state.forget_returned()
        if self.state_rule:
            staged = lane.state.stage_crossed({name: flat[self._region_index[name]] for name in entry.sites})
            for name, site in entry.sites.items():
                i = self._region_index[name]
                flat[i] = lane.state.adopt(name, staged[name], site)
            if undo is not None:
                undo.inputs = {name: flat[self._region_index[name]] for name in entry.sites}
                undo.buffers = lane.state.region_buffers
        self._stats["calls"] += 1
        if self.auditor is not None:
            self.auditor.call += 1
        # A streaming step is inference: recording autograd history would make capture impossible
        # and changes no value, so the optimized program never records it.
        with torch.no_grad():
            out = entry.gm(*flat)
        if self.state_rule:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for name, site in entry.sites.items():
                lane.state.returned(name, outs[site.output])
        return out

    def _undo_views(self, lane: Lane, entry: Entry, flat: Sequence[Any]) -> dict[str, torch.Tensor]:
        """What a default call may overwrite of the state before it and its journal does not cover: the
        views the last call returned of regions it cannot journal or that are given another state
        (copied in), and the module tensors the programs carry from call to call."""
        returned = lane.state.last_returned()
        copied_in = {n for n, v in returned.items() if n in self._region_index and flat[self._region_index[n]] is not v}
        views = whole_undo(entry.facts.journal, returned, copied_in)
        views.update({f"module:{n}": t for n, t in self.undeclared_state(lane).items()})
        return views

    def flatten_inputs(self, args: Sequence[Any], kwargs: dict[str, Any],
                       state: Mapping[str, torch.Tensor] | None = None) -> list[Any]:
        """Positional and keyword inputs as one list in the exported programs' input order; a region
        kept in a module buffer gets ``state``'s tensor (the conversation's last returned state), or
        the buffer's value at export on the conversation's first call."""
        kwargs = dict(kwargs)
        flat = list(args) + [kwargs.pop(n) for n in self._visible[len(args):] if n in kwargs]
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}; inputs are {self._visible}")
        if self.buffer_regions:
            if len(flat) != len(self._visible):
                raise TypeError(f"{len(flat)} inputs given; the program takes {len(self._visible)}: {self._visible}")
            flat = self.buffer_regions.flatten(flat, state or {})
        return flat

    def visible_outputs(self, out: Any) -> Any:
        """What the caller gets of a call's outputs: all of them, less the regions kept in module buffers."""
        return self.buffer_regions.visible_outputs(out) if self.buffer_regions else out

    def lookup(self, flat: Sequence[Any]) -> tuple[tuple, Entry]:
        """``(key, lane 0's catalog entry)`` for a call's inputs (the key selects the class on any lane);
        :class:`CatalogMiss` when none covers them."""
        return self.catalog.find(flat)

    def check_entry(self, entry: Entry) -> None:
        """Per-call guards of one entry: folded weights unchanged; refused classes counted."""
        if entry.facts.folded_weights is not None:
            entry.facts.folded_weights.check()
        if not entry.admitted:
            self._stats["not_admitted"] += 1

    def input_index(self, region: str) -> int:
        """Position of region ``region``'s state input among the program's inputs."""
        return self._region_index[region]

    def region_sites(self) -> dict[str, RegionSite]:
        return dict(self._sites[0])

    # ------------------------------------------------------------------ sessions
    def session(self, name: str | None = None, *, seed: int | None = None, pin: bool = False) -> Session:
        """A new conversation over this program's weights and graphs, with its own state buffers.

        ``seed`` seeds the session's own random streams (as ``torch.manual_seed(seed)`` would for a
        solo run); without it they start from the process's current generator states.

        ``pin``: the session takes a lane of its own (any but lane 0) for its life and its state
        stays in that lane's buffers: its calls copy no state and undo only what they overwrite
        (a shared session copies its state in and out each call); :class:`NoLaneToPin` if none is left.
        """
        if not self.state_rule:
            raise ContractError("sessions need the state rule (optimize(..., state=True))")
        self._refuse_undeclared_state("sessions")
        with self._session_lock:
            lane = self.lanes.pin() if pin else None
            s = Session(self, name or f"session-{self._session_count}", seed=seed, lane=lane)
            self._session_count += 1
            self._sessions[id(s)] = s
            owners.register(s, s.buffers())
        return s

    def sessions(self) -> list[Session]:
        """The open sessions."""
        return list(self._sessions.values())

    def forget_session(self, session: Session) -> None:
        with self._session_lock:
            self._sessions.pop(id(session), None)
            owners.unregister(session, session.buffers())
            if session.lane is not None:  # the lane's buffers go back to the lane, for the next pin
                owners.register(self._lane_owner, session.lane.state.tensors())
                self.lanes.unpin(session.lane.index)

    def new_region_buffers(self) -> dict[str, torch.Tensor]:
        """Fresh, demand-sized region buffers (a session's own)."""
        first = self._sites[0]
        return {rp.name: torch.zeros(numel(rp.session_shape), dtype=first[rp.name].dtype, device=first[rp.name].device)
                for rp in self.plan.regions}

    def evict(self, lane: Lane) -> None:
        """Before a session runs on ``lane``: copy out the default session's state resident there."""
        if lane.resident is None:
            return
        default = lane.resident
        with torch.no_grad():
            default.evicted = {name: t.clone() for name, t in default.returned.items()}
        lane.state.forget_returned()
        lane.resident = None

    def _refuse_undeclared_state(self, what: str) -> None:
        """Sessions and lanes each need their own copy of every piece of state: a module tensor the step
        writes in place that the contract does not own would be one copy shared by all of them."""
        undeclared = self.undeclared_state()
        if undeclared:
            raise ContractError(
                f"{what} need every piece of state in the contract, but the step writes module tensor(s) "
                f"{sorted(undeclared)} in place every call: one copy that every {what[:-1]} would share "
                f"(the calls of one would change the bytes of another). Declare each as a Region (its input "
                f"and output) or keep to one conversation and one lane.")

    # ------------------------------------------------------------------ warm-up and census
    def warmup(self, *example_args: Any, full_lanes: int | None = None,
               steady: Sequence[int] = (-1,)) -> dict[str, Any]:
        """Capture every catalog class on every lane before traffic; all state is left exactly as found.

        One call per exported program runs with region inputs of that program's extents; the other
        inputs come from ``example_args`` where their shapes fit and are zeros otherwise (values
        do not matter for capture, shapes do). ``full_lanes``: lanes from that number on capture only
        the ``steady`` classes (catalog positions), and calls of the others go to lanes that have them
        (:func:`~cadence_fx.runtime.warmup.warm_up`). Returns the seconds and per-class reports."""
        example_args = tuple(self.buffer_regions.flatten(example_args, {})) if self.buffer_regions else example_args
        return warm_up(self.lanes, self.census, example_args, region_index=self._region_index,
                       state_rule=self.state_rule, stats=self._stats, full_lanes=full_lanes, steady=steady)

    def warmup_in_background(self, *example_args: Any, first: int = 1) -> LaneWarmup:
        """Capture the first ``first`` lanes now and the others on a background thread, beside traffic.

        Returns once the first lanes are captured: sessions may call the program then, and take only
        lanes that are online; each later lane joins once its classes are captured and its state is
        back (:class:`~cadence_fx.runtime.warmup.LaneWarmup`: ``online()``, ``wait()``, ``error``). What
        a lane computes does not depend on when it was captured: each class is the same graph of the
        same kernels, captured under the same settings. Example arguments as for :meth:`warmup`.
        """
        example_args = tuple(self.buffer_regions.flatten(example_args, {})) if self.buffer_regions else example_args
        return LaneWarmup(self.lanes, self.census, example_args, first=first, region_index=self._region_index,
                          state_rule=self.state_rule, stats=self._stats)

    def runners(self) -> dict[str, Any]:
        """All replay engines, by lane (after the first), partition and wrapped invocation."""
        return self.census.runners()

    def counters(self) -> dict[str, Any]:
        """Replays, fallbacks, rejections by reason, invalidations, captures (over runners and lanes;
        warm-up counts only its captures) and ``drawing``: callables whose replays draw, ``declared``
        by an op or ``found_by_probe`` (a capture saw the device generator move)."""
        return self.census.counters()

    def memory_census(self) -> dict[str, int]:
        """Bytes the program holds on its device, by kind: parameters, constants (buffers and hoisted
        constants), regions, workspaces, graph pools (reserved by captures), staging buffers (all
        lanes), and the open sessions' own region buffers."""
        return self.census.memory(self.sessions())

    def undeclared_state(self, lane: Lane | None = None) -> dict[str, torch.Tensor]:
        """Module tensors the programs write in place and read back in a later call that the contract
        does not own (neither a region nor a workspace), by attribute name (:meth:`Census.undeclared_state`)."""
        return self.census.undeclared_state(lane)

    # ------------------------------------------------------------------ introspection
    @property
    def stats(self) -> dict[str, Any]:
        """Calls, calls in classes the admission predicate refused, region inputs copied in
        (``state_adopted``) and used in place (``state_in_place``), nodes changed per pass."""
        counts = self.state.counts
        return {**self._stats, "state_adopted": counts.adopted, "state_in_place": counts.in_place}

    @property
    def region_buffers(self) -> dict[str, torch.Tensor]:
        """Each region's contract-owned flat buffer, by region name."""
        return dict(self.state.region_buffers)

    def region_pointer(self, name: str) -> int:
        """The data pointer every returned state view of region ``name`` starts at."""
        return self.state.region_buffer(name).data_ptr()

    def workspaces(self) -> list[torch.Tensor]:
        """The demand-sized workspace copies (one per stock workspace, shared by every class)."""
        return self.state.workspaces()

    def owned_storages(self) -> frozenset[int]:
        """Storage data pointers of everything the program owns as state (regions, workspaces)."""
        return self.state.owned_storages()

    def graph_modules(self) -> list[GraphModule]:
        """The rewritten module of each catalog class, in catalog order."""
        return [e.gm for e in self.catalog.values()]

    def state_counts(self) -> dict[str, int]:
        """Region inputs copied in (``adopted``) and used in place (``in_place``), summed over regions."""
        return {"adopted": self.state.counts.adopted, "in_place": self.state.counts.in_place}

    def folded_weights(self) -> list[FoldedWeights]:
        """Per program, the weights its hoisted cones read (guarded against in-place edits)."""
        return [e.facts.folded_weights for e in self.catalog.values() if e.facts.folded_weights is not None]

    def verify_weights(self) -> None:
        """Compare every weight a hoisted cone read with its bits at ``optimize`` time (a full read).

        The per-call guard sees in-place edits through the weight (``mul_``, ``copy_``, ``load_state_dict``);
        one through ``.data`` bypasses its version counter, and only this check (or optimizing again)
        catches it. Raises :class:`cadence_fx.WeightsChanged`."""
        for fw in self.folded_weights():
            fw.verify()


def optimize(exported: ExportedProgram | Sequence[ExportedProgram], contract: Contract, *,
             verify: bool = False, replay: Replay | Any = "auto", state: bool = True,
             lanes: int = 1, transactional: bool = True, journal: bool = False) -> OptimizedProgram:
    """Rewrite a streaming step under ``contract`` and return a drop-in replacement for ``ep.module()``.

    Args:
        exported: one ``torch.export`` program of the step, or one per catalog class (the extents
            ``cadence_fx.call_classes`` lists) when the step is exported with static shapes.
        contract: the native-clock contract.
        verify: shadow-run the stock concatenation at every carry append and retention and raise
            :class:`cadence_fx.RetentionMismatch` on the first differing element.
        replay: ``"auto"``: CUDA graphs when CUDA is available (eager otherwise), with parallel branch
            streams when ``lanes == 1``; ``"off"`` never replays; or a replay backend object.
        state: apply the state rule (contract-owned region buffers, in-place writeback). Off, the
            regions stay as the program allocates them: the single-rule cells of the factorial.
        lanes: how many session calls may run at once: each lane is one copy of the rewritten
            programs with its own state buffers, workspaces, graph pool and CUDA stream (weights and
            hoisted constants are shared). Sessions (:meth:`OptimizedProgram.session`) are not lanes:
            any number of them share the lanes, each call copying its state in and out, unless pinned
            to a lane of their own (``session(pin=True)``).
        transactional: a default-program call (``prog(...)``) that raises leaves the state exactly as
            before it. Off, a call that raises leaves the regions undefined. Session calls are
            transactions either way: a shared session's lane buffers are scratch until its commit.
        journal: the graphs save what each region write overwrites, and the undo of the default program's
            and pinned sessions' calls moves that, not whole regions (``passes.journal_writes``; off: it
            costs chains of small kernels more than the copies it saves, docs/benchmarks.md).

    Raises:
        ContractError: the contract is inconsistent with itself or with the exported programs.
    """
    eps = [exported] if isinstance(exported, ExportedProgram) else list(exported)
    if not eps:
        raise ContractError("optimize: no exported program given")
    check_lanes(lanes)  # before the source folds the programs' shared weights
    source = PassesSource(eps, contract, verify=verify, state=state, journal=journal)
    return OptimizedProgram(source, replay=replay, lanes=lanes, transactional=transactional)
