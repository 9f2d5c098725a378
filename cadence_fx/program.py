"""``cadence_fx.optimize``: the drop-in replacement for ``exported_program.module()``.

The façade: it plans, binds the contract to each exported program, runs the pass pipeline once per
program and assembles the runtime (:mod:`cadence_fx.runtime`): the catalog that dispatches calls,
the state store that owns the regions and workspaces, and the replay runners.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import replace
from typing import Any, Literal, Sequence

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from cadence_fx.runtime.audit import Auditor
from cadence_fx.binding import RegionSite, bind_regions
from cadence_fx.shared_weights import share_catalog_tensors
from cadence_fx.contract import Contract, ContractError
from cadence_fx.analysis.graph_io import fetch_attr, numel
from cadence_fx.analysis.writes import attribute_writes
from cadence_fx.passes import PassConfig, PassContext, ProgramFacts
from cadence_fx.runtime.workspaces import CatalogTables
from cadence_fx.runtime.weights import FoldedWeights
from cadence_fx.runtime.workspaces import rebind_shared_workspaces, release_stale_workspaces
from cadence_fx.pipeline import run_pipeline
from cadence_fx.plan import Plan, plan as make_plan
from cadence_fx.progress import Progress
from cadence_fx.runtime.catalog import Catalog, CatalogMiss, input_names, program_key
from cadence_fx.runtime.clone import NotCopyable, copy_lane
from cadence_fx.runtime.lanes import LANE_STREAM_PRIORITY, Entry, Lane, LanePool, privatize_written_buffers
from cadence_fx.runtime import owners
from cadence_fx.runtime.backends import CudaGraphBackend
from cadence_fx.runtime.rng import RngStates, draw_random
from cadence_fx.runtime.runners import RandomGuard, ReplayRunner, RunnerSet, install_runners, isolate_randomness
from cadence_fx.runtime.sessions import Session
from cadence_fx.runtime.state import StateStore
from cadence_fx.runtime.transaction import UndoLog

log = logging.getLogger("cadence_fx")

Replay = Literal["auto", "off"]

__all__ = ["CatalogMiss", "OptimizedProgram", "optimize"]


class _DefaultState:
    """The program's own calls (the default session): their state stays in lane 0's buffers, until a
    session that needs lane 0 copies it out (evicts it) into buffers of its own."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.evicted: dict[str, torch.Tensor] = {}  # region -> the default state's bytes, once evicted
        self.returned: dict[str, torch.Tensor] = {}  # what the default session's last call returned

    def last_returned(self) -> dict[str, torch.Tensor]:
        return dict(self.returned)

    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor:
        for name, t in self.returned.items():
            if t is returned and name in self.evicted:
                return self.evicted[name]
        return returned


class OptimizedProgram:
    """Callable like ``exported_program.module()``; owns the region buffers and the replay runners.

    Outputs that are not state regions are bit-identical to the unmodified program on every call.
    State outputs are views of contract-owned buffers that the next call overwrites: feed the state
    a call returns back as it is (used in place), or feed any other tensor (a snapshot restored at a
    turn boundary) and it is copied into the buffer. A view of a buffer that is not the last
    returned state (kept from an older call) is refused with :class:`cadence_fx.StaleState`.

    Many conversations: :meth:`session` hands out sessions with state of their own over the same
    weights and graphs; ``optimize(..., lanes=n)`` builds n graph sets that run session calls at once.
    """

    def __init__(self, exported: Sequence[ExportedProgram], contract: Contract, *, verify: bool,
                 replay: Replay | Any, state: bool = True, lanes: int = 1, transactional: bool = True) -> None:
        check_lanes(lanes)
        # programs saved and loaded separately carry one copy of the weights each: fold them into one
        shared_bytes = share_catalog_tensors(exported)
        self._setup(contract, plan=make_plan(exported, contract), names=input_names(exported[0]),
                    sites=[bind_regions(ep, contract) for ep in exported], verify=verify, replay=replay, state=state,
                    transactional=transactional)
        self.shared_bytes = shared_bytes
        self._exported = list(exported)
        self._assemble(lanes)
        self._exported = []  # the rewritten programs hold what they need; the stock workspaces can go

    def _setup(self, contract: Contract, *, plan: Plan, names: list[str], sites: list[dict[str, RegionSite]],
               verify: bool, replay: Replay | Any, state: bool, transactional: bool = True) -> None:
        """Everything but the lanes: shared by :func:`optimize` and a program loaded from an artifact
        (:func:`cadence_fx.load`), which supplies the plan and the sites it stored."""
        self.contract = contract
        self.state_rule = state
        self.transactional = transactional
        self.shared_bytes = 0
        self.plan = plan
        self.auditor = Auditor() if verify else None
        self._exported: list[ExportedProgram] = []
        self._names = list(names)
        self._region_index = {r.name: self._names.index(r.input) for r in contract.regions}
        self._backend = _pick_backend(replay)
        # regions in the envelope layout: every site views its buffer through the same envelope
        env = {rp.name: rp.stored_shape for rp in plan.regions if rp.layout == "envelope"} if state else {}
        self._sites = [{n: replace(s, envelope=env[n]) if n in env else s for n, s in by_name.items()}
                       for by_name in sites]
        self._config = PassConfig(contract=contract, state_rule=state, verify=verify and state, auditor=self.auditor)
        # hoisted constants and weight digests are shared by every lane; workspaces are per lane
        self._shared = CatalogTables()
        self._stats: dict[str, Any] = {"calls": 0, "not_admitted": 0, "passes": {}}
        # held weakly: a session dropped without close() is reclaimed with its buffers
        self._sessions: "weakref.WeakValueDictionary[int, Session]" = weakref.WeakValueDictionary()
        self._lane_owner = _NoReturned()  # lanes after the first: no state is ever returned from them
        self._session_lock = threading.Lock()
        self._session_count = 0
        self._writes_by_lane: dict[int, dict[str, tuple[torch.Tensor, bool]]] = {}
        self._first_lane: list[tuple[tuple, Entry]] = []  # lane 0's programs in catalog order: what lanes copy

    def _assemble(self, lanes: int) -> None:
        """Build lane 0 (recording the passes' counts), check the extents, build the other lanes."""
        with Progress(self._progress_label(), len(self._sites) * lanes) as bar:
            lane0 = self._build_lane(0, self._backend, record=True, bar=bar)
            _check_extents(self.contract, self.plan, self._sites)  # after the passes: theirs name the node that differs
            self.lanes = LanePool([lane0])
            for _ in range(lanes - 1):
                backend = self._backend.fork() if hasattr(self._backend, "fork") else self._backend
                self.lanes.add(self._build_lane(len(self.lanes.lanes), backend, bar=bar))
        self._default = _DefaultState(lane0)
        lane0.resident = self._default
        for lane in self.lanes.lanes:
            owners.register(self._default if lane.index == 0 else self._lane_owner, lane.state.tensors())
        self.state = lane0.state
        self.catalog = lane0.catalog

    def _progress_label(self) -> str:
        return "cadence_fx optimize"

    def _copy_first_lane(self, index: int, store: StateStore, tables: CatalogTables
                         ) -> list[tuple[tuple, GraphModule]] | None:
        """Lane ``index``'s programs as copies of lane 0's (:func:`copy_lane`); None for lane 0, in
        verify mode (which audits each lane's own pass run), or where lane 0's programs cannot be
        copied: the passes then build the lane."""
        if index == 0 or self.auditor is not None:
            return None
        try:
            return copy_lane(self.lanes.lanes[0], [(key, e.gm) for key, e in self._first_lane], store,
                             tables.workspaces)
        except NotCopyable as e:
            log.info("lane %d: rewritten by the passes (lane 0's programs cannot be copied: %s)", index, e)
            return None

    def _rewrite(self, index: int, facts: ProgramFacts, tables: CatalogTables) -> tuple[tuple, GraphModule]:
        """Catalog program ``index`` rewritten for one lane: ``(its catalog key, the annotated module)``.

        ``facts`` carries the lane's region buffers in and the passes' findings out. A program loaded
        from an artifact overrides this: it rebuilds the stored graph instead of running the passes.
        """
        ep = self._exported[index]
        # ep.module() is a fresh GraphModule over the same parameters and buffers, as the user gets
        return program_key(ep), run_pipeline(ep.module(), PassContext(self._config, tables, facts))

    def _build_lane(self, index: int, backend: Any, *, record: bool = False, bar: Progress | None = None) -> Lane:
        """Rewrite every exported program for one lane: its own state buffers, workspaces and runners."""
        first = self._sites[0]
        store = StateStore({
            rp.name: torch.zeros(numel(rp.stored_shape), dtype=first[rp.name].dtype, device=first[rp.name].device)
            for rp in self.plan.regions} if self.state_rule else {})
        tables = CatalogTables(constants=self._shared.constants, digests=self._shared.digests,
                               retraced=self._shared.retraced)
        runners = RunnerSet()
        private: dict[int, torch.Tensor] = {}
        entries = []
        copies = self._copy_first_lane(index, store, tables)
        for i, sites in enumerate(self._sites):
            admitted = self._admit(sites, log_refusal=record)
            if copies is not None:  # lane 0's findings, this lane's region buffers
                key, gm = copies[i]
                facts = replace(self._first_lane[i][1].facts, sites=sites, region_buffers=dict(store.region_buffers))
            else:
                facts = ProgramFacts(sites=sites, region_buffers=dict(store.region_buffers))
                key, gm = self._rewrite(i, facts, tables)
            # lane 0 runs on the stock module's scratch buffers; the others get their own copies
            privatize_written_buffers(gm, private, clone=index > 0)
            if backend is not None and admitted:
                install_runners(gm, backend, runners)
            isolate_randomness(gm)
            entries.append((key, Entry(gm, sites, facts, admitted)))
            if index == 0:
                self._first_lane.append(entries[-1])
            if record:
                for k, v in facts.changed.items():
                    self._stats["passes"][k] = self._stats["passes"].get(k, 0) + v
            if bar is not None:
                bar.advance(note=f"lane {index}, program {i + 1}/{len(self._sites)}")
        rekey = {}
        for name, site in first.items():
            if site.live and self.state_rule:
                rekey[self._region_index[name]] = {d: (n, site.shape[d]) for d, n in site.live}
        try:
            catalog: Catalog[Entry] = Catalog(self._names, entries, rekey=rekey)
        except ValueError as e:
            raise ContractError(str(e)) from None
        for _key, entry in catalog.items():
            rebind_shared_workspaces(entry.gm, tables.workspaces)
        store.set_workspaces([e.tensor for e in tables.workspaces.values() if e.tensor is not None])
        release_stale_workspaces(tables.workspaces)
        stream = None
        if index > 0 and backend is not None and getattr(backend, "device_type", None) == "cuda":
            stream = torch.cuda.Stream(backend.device, priority=LANE_STREAM_PRIORITY)
        lane = Lane(index, catalog, store, runners, stream=stream, scratch=list(private.values()))
        return lane

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One call of the default session (lane 0, state kept in place between calls).

        A call that raises leaves the state as before it: the regions' bytes, the state the next call
        accepts in place, the random generators (:class:`cadence_fx.runtime.transaction.UndoLog`;
        ``optimize(..., transactional=False)`` skips the copy, and a call that raises then leaves the
        regions undefined: feed the next call a state of your own)."""
        flat = self.flatten_inputs(args, kwargs)
        with self.lanes.take(0) as lane, lane.on_stream():  # after a session's call on lane 0 from another stream
            entry = lane.catalog.lookup(flat)
            self.check_entry(entry)
            evicted = lane.resident is not self._default  # a session used lane 0 since: our state was copied out
            returned = lane.state.last_returned()
            undo = UndoLog(self._undo_views(lane)) if self.transactional and not evicted else None
            rng = RngStates.current() if self._draws(entry) else None
            try:
                out = self._call_default(lane, entry, flat, evicted)
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
            return out

    def _call_default(self, lane: Lane, entry: Entry, flat: list[Any], evicted: bool) -> Any:
        if evicted:
            for name, t in self._default.returned.items():
                i = self._region_index[name]
                if flat[i] is t:
                    flat[i] = self._default.evicted.get(name, t)
            lane.state.forget_returned()
        if self.state_rule:
            for name, site in entry.sites.items():
                i = self._region_index[name]
                flat[i] = lane.state.adopt(name, flat[i], site)
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
                lane.state.returned(name, outs[site.region.output])
        return out

    def _undo_views(self, lane: Lane) -> dict[str, torch.Tensor]:
        """What a default call may overwrite of the state before it: the views the last call returned
        and the module tensors the programs carry from call to call."""
        views = dict(lane.state.last_returned())
        views.update({f"module:{n}": t for n, t in self.undeclared_state(lane).items()})
        return views

    def _draws(self, entry: Entry) -> bool:
        """Whether the entry's program draws randomness (a failed call's draws are undone)."""
        if entry.draws is None:
            entry.draws = any(isinstance(m, RandomGuard) or (isinstance(m, ReplayRunner) and m.random)
                              for m in entry.gm.modules()) or \
                any(n.target is draw_random for n in entry.gm.graph.nodes if n.op == "call_function")
        return entry.draws

    def flatten_inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Positional and keyword inputs as one list in the exported programs' input order."""
        kwargs = dict(kwargs)
        flat = list(args) + [kwargs.pop(n) for n in self._names[len(args):] if n in kwargs]
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}; inputs are {self._names}")
        return flat

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

    def _admit(self, sites: dict[str, RegionSite], *, log_refusal: bool = True) -> bool:
        """The contract's admission predicate on this class's clock values (strides and region extents).

        A class the predicate refuses is never replayed: its calls run eagerly and are counted in
        ``stats["not_admitted"]`` (a flush with a short last chunk is the usual case).
        """
        if self.contract.admit is None:
            return True
        values = {c.name: c.stride for c in self.contract.clocks}
        values.update({name: site.extent for name, site in sites.items()})
        admitted = bool(self.contract.admit(values))
        if not admitted and log_refusal:
            log.warning("class %s refused by the contract's admission predicate: replay off, eager", values)
        return admitted

    # ------------------------------------------------------------------ sessions
    def session(self, name: str | None = None, *, seed: int | None = None) -> Session:
        """A new conversation over this program's weights and graphs, with its own state buffers.

        ``seed`` seeds the session's own random streams (as ``torch.manual_seed(seed)`` would for a
        solo run); without it they start from the process's current generator states.
        """
        if not self.state_rule:
            raise ContractError("sessions need the state rule (optimize(..., state=True))")
        self._refuse_undeclared_state("sessions")
        with self._session_lock:
            s = Session(self, name or f"session-{self._session_count}", seed=seed)
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

    # ------------------------------------------------------------------ replay
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
        total: dict[str, Any] = {"replays": 0, "eager": 0, "invalidations": 0, "captures": 0, "rejections": {}}
        for lane in self.lanes.lanes:
            c = lane.runners.counters()
            for k in ("replays", "eager", "invalidations", "captures"):
                total[k] += c[k]
            for reason, n in c["rejections"].items():
                total["rejections"][reason] = total["rejections"].get(reason, 0) + n
        return total

    def warmup(self, *example_args: Any) -> dict[str, Any]:
        """Capture every catalog class on every lane before traffic; all state is left exactly as found.

        One call per exported program runs with region inputs of that program's extents; the other
        inputs come from ``example_args`` where their shapes fit and are zeros otherwise (values
        do not matter for capture, shapes do). Returns the warm-up seconds and per-class reports.
        """
        t0 = time.perf_counter()
        stats = {k: v for k, v in self._stats.items() if isinstance(v, int)}
        bar = Progress("cadence_fx capture", sum(len(lane.catalog) for lane in self.lanes.lanes))
        for lane in self.lanes.lanes:
            with self.lanes.take(lane.index), lane.state.preserved(self._written_buffers(lane)) as restored, \
                    lane.runners.traffic_counters_paused(), lane.runners.gate.open(restored), \
                    lane.on_stream(), torch.no_grad():
                # the largest classes first: the lane's engines stage into one arena, which then
                # never has to grow for a later class (a grown arena keeps the old one alive)
                for key, entry in sorted(lane.catalog.items(), key=lambda kv: -_input_bytes(kv[0])):
                    flat = self._warmup_args(lane, key, entry, example_args)
                    if self.state_rule:
                        for name, site in entry.sites.items():
                            i = self._region_index[name]
                            flat[i] = lane.state.adopt(name, flat[i], site)
                    entry.gm(*flat)
                    bar.advance(note=f"lane {lane.index}")
            if lane.stream is not None:
                torch.cuda.current_stream(lane.stream.device).wait_stream(lane.stream)
        bar.close()
        self._stats.update(stats)
        return {"seconds": time.perf_counter() - t0,
                "classes": {name: dict(eng.classes) for name, eng in self.runners().items()}}

    def _written_buffers(self, lane: Lane) -> list[torch.Tensor]:
        """Module tensors the lane's programs write in place besides its regions and workspaces (a
        step's own call counter, a scratch buffer): warm-up runs the programs, so it puts these back."""
        return [t for t, _carried in self._module_writes(lane).values()]

    def undeclared_state(self, lane: Lane | None = None) -> dict[str, torch.Tensor]:
        """Module tensors the programs write in place and read back in a later call that the contract
        does not own (neither a region nor a workspace), by attribute name: state every caller of the
        program shares (lane 0's programs, or ``lane``'s). Scratch the step writes before it reads
        (the solver's per-step cache buffer) is not state and is not listed."""
        return {name: t for name, (t, carried) in self._module_writes(lane).items() if carried}

    def _module_writes(self, lane: Lane | None = None) -> dict[str, tuple[torch.Tensor, bool]]:
        """``{attribute: (tensor, carried)}`` of :func:`attribute_writes` over the lane's programs, less
        what the lane owns; worked out once per lane (the programs do not change after they are built)."""
        lane = lane if lane is not None else self.lanes.lanes[0]
        if lane.index in self._writes_by_lane:
            return self._writes_by_lane[lane.index]
        owned = lane.state.owned_storages()
        out: dict[str, tuple[torch.Tensor, bool]] = {}
        seen: dict[int, str] = {}
        for entry in lane.catalog.values():
            for target, carried in sorted(attribute_writes(entry.gm).items()):
                value = fetch_attr(entry.gm, target)
                if not isinstance(value, torch.Tensor) or value.untyped_storage().data_ptr() in owned:
                    continue
                name = seen.setdefault(id(value), target)
                out[name] = (value, carried or out.get(name, (value, False))[1])
        self._writes_by_lane[lane.index] = out
        return out

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

    def _warmup_args(self, lane: Lane, key: tuple, entry: Entry, example_args: Sequence[Any]) -> list[Any]:
        regions = {self._region_index[name]: name for name in entry.sites} if self.state_rule else {}
        device = next((t.device for t in lane.state.region_buffers.values()), None)
        # an input with no example is made where the exported program expects it (without the state
        # rule there are no region buffers to go by, and a state made on the host would be captured)
        recorded = [n.meta.get("val") for n in entry.gm.graph.nodes if n.op == "placeholder"]
        flat = []
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

        The per-call guard sees in-place edits through the weight itself (``mul_``, ``copy_``,
        ``load_state_dict``); an edit through ``.data`` bypasses the version counter it reads, and
        only this check (or optimizing again) catches it. Raises :class:`cadence_fx.WeightsChanged`.
        """
        for fw in self.folded_weights():
            fw.verify()

    def memory_census(self) -> dict[str, int]:
        """Bytes the program holds on its device, by kind: parameters, constants (buffers and hoisted
        constants), regions, workspaces, graph pools (reserved by captures), staging buffers (all
        lanes), and the open sessions' own region buffers."""
        owned = frozenset().union(*(lane.state.owned_storages() for lane in self.lanes.lanes))
        seen: dict[int, tuple[str, int]] = {}
        for gm in [e.gm for lane in self.lanes.lanes for e in lane.catalog.values()]:
            for kind, tensors in (("parameters", gm.parameters()), ("constants", gm.buffers())):
                for t in tensors:
                    st = t.untyped_storage()
                    if st.data_ptr() not in owned:
                        seen.setdefault(st.data_ptr(), (kind, st.nbytes()))
        out = {"parameters": 0, "constants": 0}
        for kind, nbytes in seen.values():
            out[kind] += nbytes
        for lane in self.lanes.lanes:
            for part in (lane.state.nbytes(), lane.runners.memory()):
                for k, v in part.items():
                    out[k] = out.get(k, 0) + v
        out["sessions"] = sum(s.nbytes() for s in self.sessions())
        return out


class _NoReturned:
    """The owner of a lane's buffers other than lane 0's: no session's state is ever left there."""

    def last_returned(self) -> dict[str, torch.Tensor]:
        return {}

    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor:
        return returned


def optimize(exported: ExportedProgram | Sequence[ExportedProgram], contract: Contract, *,
             verify: bool = False, replay: Replay | Any = "auto", state: bool = True,
             lanes: int = 1, transactional: bool = True) -> OptimizedProgram:
    """Rewrite a streaming step under ``contract`` and return a drop-in replacement for ``ep.module()``.

    Args:
        exported: one ``torch.export`` program of the step, or one per catalog class (the extents
            ``cadence_fx.call_classes`` lists) when the step is exported with static shapes.
        contract: the native-clock contract.
        verify: shadow-run the stock concatenation at every carry append and retention and raise
            :class:`cadence_fx.RetentionMismatch` on the first differing element.
        replay: ``"auto"`` replays wrapped partitions through CUDA graphs when CUDA is available
            (eager otherwise), ``"off"`` never replays, or a replay backend object.
        state: apply the state rule (contract-owned region buffers, in-place writeback). Off, the
            regions stay as the program allocates them: the single-rule cells of the factorial.
        lanes: how many session calls may run at once: each lane is one copy of the rewritten
            programs with its own state buffers, workspaces, graph pool and CUDA stream (weights and
            hoisted constants are shared). Sessions (:meth:`OptimizedProgram.session`) are not lanes:
            any number of them share the lanes, each call copying its state in and out.
        transactional: a default-program call (``prog(...)``) that raises leaves the state exactly as
            before it; it costs one device copy of the live state per call (an undo log). Off, a call
            that raises leaves the regions undefined. Session calls are transactions either way, at
            no cost: their lane buffers are scratch until the commit.

    Raises:
        ContractError: the contract is inconsistent with itself or with the exported programs.
    """
    eps = [exported] if isinstance(exported, ExportedProgram) else list(exported)
    if not eps:
        raise ContractError("optimize: no exported program given")
    return OptimizedProgram(eps, contract, verify=verify, replay=replay, state=state, lanes=lanes,
                            transactional=transactional)


def _input_bytes(key: tuple) -> int:
    """Bytes of the tensor inputs a catalog key describes (symbolic sizes count as 0)."""
    total = 0
    for k in key:
        if k[0] == "T" and all(isinstance(n, int) for n in k[1]):
            total += math.prod(k[1]) * k[2].itemsize
    return total


def check_lanes(lanes: object) -> None:
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
        raise ValueError(f"lanes must be a positive int, got {lanes!r}")


def _pick_backend(replay: Replay | Any) -> Any:
    if replay == "off":
        return None
    if replay == "auto":
        backend = CudaGraphBackend()
        return backend if backend.available() else None
    return replay


def _check_extents(contract: Contract, plan: Plan, all_sites: list[dict[str, RegionSite]]) -> None:
    """Every exported program's region extents must be a class the contract reaches (``initial``,
    growth and retention agree with what was exported); classes no program covers are logged."""
    if not contract.regions:
        return
    for sites in all_sites:
        for name, site in sites.items():
            rp = plan.region(name)
            if site.extent not in rp.extents:
                r = contract.region(name)
                raise ContractError(
                    f"Region {name!r}: an exported program has extent {site.extent} on axis {site.axis} of input "
                    f"{r.input!r}, which the contract never reaches: its extents are {list(rp.extents)} (initial "
                    f"{r.initial}, +{contract.growth(r)} per call, {r.retention!r}); check Region.initial, the "
                    f"clock stride and the retention sizes")
    seen = [{name: site.extent for name, site in sites.items()} for sites in all_sites]
    missing = [dict(c) for c in plan.classes if dict(c) not in seen]
    if missing:
        log.warning("no exported program covers catalog class(es) %s: calls in them raise CatalogMiss", missing)
