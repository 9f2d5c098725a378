"""How an optimized program's lanes are built, through one seam: a program source.

A :class:`ProgramSource` says what the programs of a catalog are (contract, plan, input names, region
sites, each class's admission) and hands out each one rewritten for a lane. Two implement it:
:class:`PassesSource` runs the pass pipeline on the exported programs (what :func:`cadence_fx.optimize`
builds) and the artifact's :class:`~cadence_fx.artifact.source.ArtifactSource` decodes a stored
manifest (what :func:`cadence_fx.load` builds). :class:`LaneBuilder` assembles the lanes from either:
lane 0 from the source, the extents checked, the other lanes as copies of lane 0's programs where
the source allows it (:func:`~cadence_fx.runtime.clone.copy_lane`), from the source again otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Literal, Protocol, Sequence

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from cadence_fx.analysis.graph_io import numel
from cadence_fx.binding import RegionSite, bind_regions
from cadence_fx.buffer_regions import NO_BUFFER_REGIONS, BufferRegions, lift_buffer_regions
from cadence_fx.contract import Contract, ContractError
from cadence_fx.gc_paused import cyclic_gc_paused
from cadence_fx.passes import PassConfig, PassContext, ProgramFacts
from cadence_fx.pipeline import run_pipeline
from cadence_fx.plan import Plan, plan as make_plan
from cadence_fx.progress import Progress
from cadence_fx.runtime.audit import Auditor
from cadence_fx.runtime.backends import CudaGraphBackend
from cadence_fx.runtime.catalog import Catalog, CatalogMiss, input_names, phase_of, program_key
from cadence_fx.runtime.clone import NotCopyable, copy_lane
from cadence_fx.runtime.lanes import LANE_STREAM_PRIORITY, Entry, Lane, LanePool, privatize_written_buffers
from cadence_fx.runtime.runners import RunnerSet, install_runners, isolate_randomness
from cadence_fx.runtime.state import StateStore
from cadence_fx.runtime.streams import held_stream
from cadence_fx.runtime.workspaces import CatalogTables, rebind_shared_workspaces, release_stale_workspaces
from cadence_fx.shared_weights import share_catalog_tensors

log = logging.getLogger("cadence_fx")

Replay = Literal["auto", "off"]

__all__ = ["LaneBuilder", "PassesSource", "ProgramSource", "Replay", "check_extents", "check_lanes",
           "envelope_sites", "pick_backend"]


class ProgramSource(Protocol):
    """Where an optimized program's rewritten programs come from (one per catalog class, in order)."""

    @property
    def label(self) -> str:
        """The progress line's label while the lanes are built."""
        ...

    @property
    def contract(self) -> Contract: ...

    @property
    def plan(self) -> Plan: ...

    @property
    def names(self) -> list[str]:
        """The programs' inputs, in calling order."""
        ...

    @property
    def sites(self) -> list[dict[str, RegionSite]]:
        """Each program's region sites, by region name (before the envelope layout is applied)."""
        ...

    @property
    def state_rule(self) -> bool: ...

    @property
    def buffer_regions(self) -> BufferRegions:
        """The regions kept in module buffers: inputs the program feeds itself, outputs it drops."""
        ...

    @property
    def auditor(self) -> Auditor | None:
        """Verify mode's auditor (``None`` off)."""
        ...

    @property
    def shared_bytes(self) -> int:
        """Bytes of duplicate weights folded into one copy while the source was made."""
        ...

    @property
    def copyable(self) -> bool:
        """Whether a lane after the first may be a copy of lane 0's programs (else the source builds it)."""
        ...

    def admitted(self, index: int, *, log_refusal: bool) -> bool:
        """Whether program ``index``'s class is replayed (the contract's admission predicate)."""
        ...

    def rewrite(self, index: int, facts: ProgramFacts, tables: CatalogTables) -> tuple[tuple, GraphModule]:
        """Program ``index`` rewritten for one lane: ``(its catalog key, the annotated module)``.

        ``facts`` carries the lane's region buffers in and the program's findings out; ``tables`` is the
        lane's (hoisted constants and digests shared by every lane, workspaces the lane's own)."""
        ...


class PassesSource:
    """The exported programs of a catalog, each rewritten by the pass pipeline (:func:`cadence_fx.optimize`).

    Made in the order ``optimize`` always did it: programs saved and loaded separately carry one copy
    of the weights each, folded into one first; then the plan, the input names and the region sites.
    """

    label = "cadence_fx optimize"

    def __init__(self, exported: Sequence[ExportedProgram], contract: Contract, *, verify: bool,
                 state: bool = True, journal: bool = True) -> None:
        self._phases = _phases(exported, contract)
        # a region kept in a module buffer becomes one more input and output of every program
        exported, contract, self._buffer_regions = lift_buffer_regions(exported, contract) if state else \
            (list(exported), contract, NO_BUFFER_REGIONS)
        if not state and any(r.output is None for r in contract.regions):
            raise ContractError("module-buffer regions (Region.output=None) need the state rule (state=True)")
        self._shared_bytes = share_catalog_tensors(exported)
        self._contract = contract
        self._plan = make_plan(exported, contract)
        self._names = input_names(exported[0])
        self._sites = [bind_regions(ep, contract) for ep in exported]
        self._state_rule = state
        self._auditor = Auditor() if verify else None
        self._config = PassConfig(contract=contract, state_rule=state, verify=verify and state, auditor=self._auditor,
                                  journal=journal)
        self._exported = list(exported)

    @property
    def contract(self) -> Contract:
        return self._contract

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def sites(self) -> list[dict[str, RegionSite]]:
        return self._sites

    @property
    def state_rule(self) -> bool:
        return self._state_rule

    @property
    def buffer_regions(self) -> BufferRegions:
        return self._buffer_regions

    @property
    def auditor(self) -> Auditor | None:
        return self._auditor

    @property
    def shared_bytes(self) -> int:
        return self._shared_bytes

    @property
    def copyable(self) -> bool:
        # verify mode audits each lane's own pass run
        return self._auditor is None

    def admitted(self, index: int, *, log_refusal: bool) -> bool:
        """The contract's admission predicate on this class's clock values (strides and region extents).

        A class the predicate refuses is never replayed: its calls run eagerly and are counted in
        ``stats["not_admitted"]`` (a flush with a short last chunk is the usual case).
        """
        if self._contract.admit is None:
            return True
        values = {c.name: c.stride for c in self._contract.clocks}
        values.update({name: site.extent for name, site in self._sites[index].items()})
        admitted = bool(self._contract.admit(values))
        if not admitted and log_refusal:
            log.warning("class %s refused by the contract's admission predicate: replay off, eager", values)
        return admitted

    def rewrite(self, index: int, facts: ProgramFacts, tables: CatalogTables) -> tuple[tuple, GraphModule]:
        ep = self._exported[index]
        # ep.module() is a fresh GraphModule over the same parameters and buffers, as the user gets
        key = program_key(ep) + ((("P", self._phases[index]),) if self._phases is not None else ())
        try:
            return key, run_pipeline(ep.module(), PassContext(self._config, tables, facts))
        except ContractError as e:  # which of the catalog's programs contradicts the contract
            cls = ", ".join(f"{n}={s.extent}" for n, s in self._sites[index].items())
            raise ContractError(f"exported program {index} (class {cls or 'with no regions'}): {e}") from None


class LaneBuilder:
    """Builds a program's lanes from its source: each lane's own state buffers, workspaces and runners.

    ``sites``: each program's region sites as the program views its buffers (:func:`envelope_sites`);
    ``passes``: the node counts the passes changed on lane 0, filled as it is built.
    """

    def __init__(self, source: ProgramSource, *, sites: list[dict[str, RegionSite]], region_index: dict[str, int],
                 backend: Any) -> None:
        self.source = source
        self.sites = sites
        self.region_index = region_index
        self.backend = backend
        self.passes: dict[str, int] = {}
        # hoisted constants and weight digests are shared by every lane; workspaces are per lane
        self._shared = CatalogTables()
        self._first_lane: list[tuple[tuple, Entry]] = []  # lane 0's programs in catalog order: what lanes copy
        self._lane0: Lane | None = None
        self._verdicts: dict[str, dict] = {}  # the probes' findings, shared by the lanes' engines

    def build(self, lanes: int) -> LanePool:
        """Build lane 0 (recording the passes' counts), check the extents, build the other lanes."""
        source = self.source
        with cyclic_gc_paused(), Progress(source.label, len(self.sites) * lanes) as bar:
            lane0 = self.build_lane(0, self.backend, record=True, bar=bar)
            self._lane0 = lane0
            check_extents(source.contract, source.plan, self.sites)  # after the passes: theirs name the node that differs
            pool = LanePool([lane0])
            for _ in range(lanes - 1):
                backend = self.backend.fork() if hasattr(self.backend, "fork") else self.backend
                pool.add(self.build_lane(len(pool.lanes), backend, bar=bar))
        return pool

    def copy_first_lane(self, index: int, store: StateStore, tables: CatalogTables
                        ) -> list[tuple[tuple, GraphModule]] | None:
        """Lane ``index``'s programs as copies of lane 0's (:func:`copy_lane`); None for lane 0, where the
        source does not allow it (verify mode, which audits each lane's own pass run), or where lane 0's
        programs cannot be copied: the source then builds the lane."""
        if index == 0 or not self.source.copyable or self._lane0 is None:
            return None
        try:
            return copy_lane(self._lane0, [(key, e.gm) for key, e in self._first_lane], store, tables.workspaces)
        except NotCopyable as e:
            log.info("lane %d: rewritten by the passes (lane 0's programs cannot be copied: %s)", index, e)
            return None

    def build_lane(self, index: int, backend: Any, *, record: bool = False, bar: Progress | None = None) -> Lane:
        """Rewrite every program for one lane: its own state buffers, workspaces and runners."""
        source = self.source
        first = self.sites[0]
        store = StateStore({
            rp.name: torch.zeros(numel(rp.stored_shape), dtype=first[rp.name].dtype, device=first[rp.name].device)
            for rp in source.plan.regions} if source.state_rule else {})
        tables = CatalogTables(constants=self._shared.constants, digests=self._shared.digests,
                               retraced=self._shared.retraced)
        runners = RunnerSet()
        private: dict[int, torch.Tensor] = {}
        entries = []
        copies = self.copy_first_lane(index, store, tables)
        for i, sites in enumerate(self.sites):
            admitted = source.admitted(i, log_refusal=record)
            if copies is not None:  # lane 0's findings, this lane's region buffers
                key, gm = copies[i]
                facts = replace(self._first_lane[i][1].facts, sites=sites, region_buffers=dict(store.region_buffers))
            else:
                facts = ProgramFacts(sites=sites, region_buffers=dict(store.region_buffers))
                key, gm = source.rewrite(i, facts, tables)
            # lane 0 runs on the stock module's scratch buffers; the others get their own copies
            privatize_written_buffers(gm, private, clone=index > 0)
            if backend is not None and admitted:
                install_runners(gm, backend, runners, self._verdicts)
            isolate_randomness(gm)
            entries.append((key, Entry(gm, sites, facts, admitted)))
            if index == 0:
                self._first_lane.append(entries[-1])
            if record:
                for k, v in facts.changed.items():
                    self.passes[k] = self.passes.get(k, 0) + v
            if bar is not None:
                bar.advance(note=f"lane {index}, program {i + 1}/{len(self.sites)}")
        rekey = {}
        for name, site in first.items():
            if site.live and source.state_rule:
                rekey[self.region_index[name]] = {d: (n, site.shape[d]) for d, n in site.live}
        try:
            catalog: Catalog[Entry] = Catalog(source.names, entries, rekey=rekey, phase=phase_rule(source))
        except ValueError as e:
            raise ContractError(str(e)) from None
        for _key, entry in catalog.items():
            rebind_shared_workspaces(entry.gm, tables.workspaces)
        store.set_workspaces([e.tensor for e in tables.workspaces.values() if e.tensor is not None])
        release_stale_workspaces(tables.workspaces)
        stream = None
        if index > 0 and backend is not None and getattr(backend, "device_type", None) == "cuda":
            # a stream of its own (not another lane's: lanes sharing one would wait on each other's chunks)
            stream = held_stream(backend.device, (LANE_STREAM_PRIORITY, -2, -3, 0), backend)
        return Lane(index, catalog, store, runners, stream=stream, scratch=list(private.values()))


def _phases(exported: Sequence[ExportedProgram], contract: Contract) -> list[int] | None:
    """Each program's phase (:class:`~cadence_fx.contract.Phase`): its example value's."""
    if contract.phase is None:
        return None
    out = []
    for i, ep in enumerate(exported):
        names = input_names(ep)
        if contract.phase.input not in names:
            raise ContractError(f"Contract.phase.input: {contract.phase.input!r} names no input; inputs are {names}")
        if ep.example_inputs is None:
            raise ContractError(f"Contract.phase: exported program {i} keeps no example inputs, so its phase is unknown")
        args, kwargs = ep.example_inputs
        flat = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        try:
            out.append(phase_of(flat, names.index(contract.phase.input), contract.phase.of))
        except CatalogMiss as e:
            raise ContractError(f"Contract.phase: exported program {i}: {e}") from None
    return out


def phase_rule(source: "ProgramSource") -> "tuple[int, Any] | None":
    """The catalog's phase dispatch: the phase input's position and the contract's rule."""
    phase = source.contract.phase
    return None if phase is None else (source.names.index(phase.input), phase.of)


def envelope_sites(plan: Plan, sites: list[dict[str, RegionSite]], state: bool) -> list[dict[str, RegionSite]]:
    """Regions in the envelope layout: every site views its buffer through the same envelope."""
    env = {rp.name: rp.stored_shape for rp in plan.regions if rp.layout == "envelope"} if state else {}
    return [{n: replace(s, envelope=env[n]) if n in env else s for n, s in by_name.items()} for by_name in sites]


def check_lanes(lanes: object) -> None:
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
        raise ValueError(f"lanes must be a positive int, got {lanes!r}")


# ``replay="auto"`` of a one-lane program: its graphs' independent chains captured on parallel streams
# (the same kernels, so the same bytes), which shortens a lone call; every branch stream may run matrix
# products (each one that does keeps a cuBLAS workspace: confining them to two was slower in fp32). With
# several lanes the lanes already keep the GPU busy and the branches' fences cost more than they give,
# so each lane's graphs use one stream (docs/benchmarks.md, sessions 25-26).
AUTO_BRANCHES = 3
AUTO_BLAS_STREAMS = None


def pick_backend(replay: Replay | Any, lanes: int = 1) -> Any:
    if replay == "off":
        return None
    if replay == "auto":
        backend = CudaGraphBackend(branches=AUTO_BRANCHES, blas_streams=AUTO_BLAS_STREAMS) if lanes == 1 \
            else CudaGraphBackend()
        return backend if backend.available() else None
    return replay


def check_extents(contract: Contract, plan: Plan, all_sites: list[dict[str, RegionSite]]) -> None:
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
