"""``cadence_fx.optimize``: the drop-in replacement for ``exported_program.module()``."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Sequence

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from cadence_fx.audit import Auditor
from cadence_fx.binding import RegionSite, bind_regions, input_names
from cadence_fx.catalog import share_catalog_tensors
from cadence_fx.contract import Contract, ContractError
from cadence_fx.graph_utils import numel
from cadence_fx.pipeline import run_pipeline
from cadence_fx.passes import PassContext
from cadence_fx.passes.shrink_workspace import rebind_shared_workspaces, release_stale_workspaces
from cadence_fx.plan import Plan, plan as make_plan

log = logging.getLogger("cadence_fx")

Replay = Literal["auto", "off"]


class CatalogMiss(RuntimeError):
    """A call whose region extents no exported program of this optimized program covers."""


class ReplayRunner(torch.nn.Module):
    """A wrapped partition behind the replay engine; captures a new class only during warm-up."""

    def __init__(self, fn: torch.nn.Module, engine: Any, owner: "OptimizedProgram") -> None:
        super().__init__()
        self.fn = fn
        self.engine = engine
        self._owner = [owner]  # not a submodule

    def forward(self, *args: Any) -> Any:
        if self._owner[0]._capturing:
            key = self.engine.signature(args)
            if key is not None and key not in self.engine.classes:
                self.engine.capture(*args, restored_by_caller=self._owner[0]._preserved_ptrs)
        return self.engine(*args)


class OptimizedProgram:
    """Callable like ``exported_program.module()``; owns the region buffers and the replay runners.

    Outputs that are not state regions are bit-identical to the unmodified program on every call.
    State outputs are views of contract-owned buffers: feed them back as they are (no copy, the
    data pointer is checked), or feed any other tensor (a snapshot restored at a turn boundary)
    and it is copied into the buffer.
    """

    def __init__(self, exported: Sequence[ExportedProgram], contract: Contract, *, verify: bool,
                 replay: Replay | Any, state: bool = True) -> None:
        self.contract = contract
        self.state_rule = state
        # programs saved and loaded separately carry one copy of the weights each: fold them into one
        self.shared_bytes = share_catalog_tensors(exported)
        self.plan: Plan = make_plan(exported, contract)
        self.auditor = Auditor() if verify else None
        self._capturing = False
        self._preserved_ptrs: frozenset[int] = frozenset()  # storages warm-up restores itself
        self._names = input_names(exported[0])
        self._region_index = {r.name: self._names.index(r.input) for r in contract.regions}
        self._pool = None
        self._backend = _pick_backend(replay)
        first_sites = bind_regions(exported[0], contract)
        self._stock_dims = {name: {d: (n, site.shape[d]) for d, n in site.live}
                            for name, site in first_sites.items() if site.live and state}
        self.region_buffers: dict[str, torch.Tensor] = {
            rp.name: torch.zeros(numel(rp.stored_shape), dtype=first_sites[rp.name].dtype,
                                 device=first_sites[rp.name].device)
            for rp in self.plan.regions}
        self.stats: dict[str, Any] = {"calls": 0, "state_adopted": 0, "state_in_place": 0, "not_admitted": 0,
                                      "passes": {}}
        self._programs: dict[tuple, tuple[GraphModule, dict[str, RegionSite], PassContext]] = {}
        shared: dict[int, dict] = {}
        constants: dict[tuple, list] = {}
        self._admitted: dict[tuple, bool] = {}
        for ep in exported:
            sites = bind_regions(ep, contract)
            admitted = self._admit(sites)
            ctx = PassContext(contract=contract, plan=self.plan, sites=sites, region_buffers=self.region_buffers,
                              verify=verify and state, auditor=self.auditor, state_rule=state,
                              make_runner=self._make_runner if self._backend is not None and admitted else None,
                              shared_workspaces=shared, shared_constants=constants)
            # ep.module() is a fresh GraphModule over the same parameters and buffers, as the user gets
            gm = run_pipeline(ep.module(), ctx)
            key = _key_of_program(ep)
            if key in self._programs:
                raise ContractError(f"two exported programs share the input signature {key}")
            self._programs[key] = (gm, sites, ctx)
            self._admitted[key] = admitted
            for k, v in ctx.changed.items():
                self.stats["passes"][k] = self.stats["passes"].get(k, 0) + v
        for gm, _sites, _ctx in self._programs.values():
            rebind_shared_workspaces(gm, shared)
        self._workspaces = [e["tensor"] for e in shared.values()]
        release_stale_workspaces(shared)

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = list(args) + [kwargs.pop(n) for n in self._names[len(args):] if n in kwargs]
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}; inputs are {self._names}")
        gm, sites, ctx = self._select(flat)
        if ctx.folded_weights is not None:
            ctx.folded_weights.check()
        if not self._admitted[self._last_key]:
            self.stats["not_admitted"] += 1
        for name, site in (sites.items() if self.state_rule else ()):
            i = self._region_index[name]
            flat[i] = self._adopt(name, flat[i], site)
        self.stats["calls"] += 1
        if self.auditor is not None:
            self.auditor.call += 1
        # A streaming step is inference: recording autograd history would make capture impossible
        # and changes no value, so the optimized program never records it.
        with torch.no_grad():
            return gm(*flat)

    def _select(self, flat: Sequence[Any]):
        key = [_arg_key(a) for a in flat]
        for name, stock in self._stock_dims.items():
            i = self._region_index[name]
            if key[i][0] == "T":  # a live-sized region (what this program returns) keys as the stock shape
                shape = list(key[i][1])
                for d, (n, full) in stock.items():
                    if d < len(shape) and shape[d] == n:
                        shape[d] = full
                key[i] = ("T", tuple(shape), key[i][2])
        key = tuple(key)
        hit = self._programs.get(key)
        if hit is not None:
            self._last_key = key
            return hit
        raise CatalogMiss(f"no exported program covers input signature {key}; the catalog is "
                          f"{[c for c in self.plan.classes]} (export one program per class)")

    def _adopt(self, name: str, arg: Any, site: RegionSite) -> torch.Tensor:
        buf = self.region_buffers[name]
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"region {name!r}: expected a tensor for input {site.region.input!r}, got {type(arg)}")
        if arg.data_ptr() == buf.data_ptr() and arg.is_contiguous() and arg.dtype == buf.dtype:
            self.stats["state_in_place"] += 1
            return arg
        for d, n in site.live:  # a stock-shaped state (a snapshot): only its live slots are state
            if arg.shape[d] > n:
                arg = arg.narrow(d, 0, n)
        if arg.numel() > buf.numel():
            raise ContractError(f"region {name!r}: input of shape {tuple(arg.shape)} exceeds the contract-owned "
                                f"buffer ({buf.numel()} elements, plan extent {self.plan.region(name).stored})")
        if arg.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            arg = arg.clone()  # a view into the buffer itself: copy out before overwriting
        view = buf[: arg.numel()].view(arg.shape)
        view.copy_(arg)
        self.stats["state_adopted"] += 1
        return view

    def _admit(self, sites: dict[str, RegionSite]) -> bool:
        """The contract's admission predicate on this class's clock values (strides and region extents).

        A class the predicate refuses is never replayed: its calls run eagerly and are counted in
        ``stats["not_admitted"]`` (a flush with a short last chunk is the usual case).
        """
        if self.contract.admit is None:
            return True
        values = {c.name: c.stride for c in self.contract.clocks}
        values.update({name: site.extent for name, site in sites.items()})
        admitted = bool(self.contract.admit(values))
        if not admitted:
            log.warning("class %s refused by the contract's admission predicate: replay off, eager", values)
        return admitted

    # ------------------------------------------------------------------ replay
    def _make_runner(self, fn: torch.nn.Module, *, name: str, aliased: Sequence[int],
                     readonly: Sequence[int] = (), mutable: Sequence[int] | None = None) -> ReplayRunner:
        from cadence_fx.replay import ExactShapeReplay

        if self._pool is None:
            self._pool = self._backend.new_pool()
        engine = ExactShapeReplay(fn, name=name, aliased=aliased, pool=self._pool, backend=self._backend,
                                  readonly=readonly, mutable=mutable)
        return ReplayRunner(fn, engine, self)

    def runners(self) -> dict[str, Any]:
        """All replay engines, by partition and wrapped invocation."""
        out = {}
        for _gm, _sites, ctx in self._programs.values():
            for name, runner in ctx.runners.items():
                out[f"{len(out)}:{name}"] = runner.engine
        return out

    def counters(self) -> dict[str, Any]:
        """Replays, eager fallbacks, rejections by reason, invalidations, captures (summed over runners)."""
        total: dict[str, Any] = {"replays": 0, "eager": 0, "invalidations": 0, "captures": 0, "rejections": {}}
        for eng in self.runners().values():
            c = eng.counters
            for k in ("replays", "eager", "invalidations", "captures"):
                total[k] += getattr(c, k)
            for reason, n in c.rejections.items():
                total["rejections"][reason] = total["rejections"].get(reason, 0) + n
        return total

    def warmup(self, *example_args: Any) -> dict[str, Any]:
        """Capture every catalog class before traffic; the program's state is left exactly as found.

        One call per exported program runs with region inputs of that program's extents; the other
        inputs come from ``example_args`` where their shapes fit and are zeros otherwise (values
        do not matter for capture, shapes do). Returns the warm-up seconds and per-class reports.
        """
        t0 = time.perf_counter()
        with self._preserved_state():
            self._capturing = True
            try:
                for pkey, (_gm, sites, _ctx) in self._programs.items():
                    flat = []
                    regions = {self._region_index[name] for name in sites} if self.state_rule else set()
                    for i, want in enumerate(pkey):
                        ex = example_args[i] if i < len(example_args) else None
                        if i in regions:  # replaced by a view of the region buffer below: allocate nothing
                            flat.append(None)
                            continue
                        if want[0] == "T" and (not isinstance(ex, torch.Tensor) or _arg_key(ex) != want):
                            device = ex.device if isinstance(ex, torch.Tensor) else next(
                                iter(self.region_buffers.values())).device
                            ex = torch.zeros(want[1], dtype=want[2], device=device)
                        flat.append(ex)
                    for name, site in (sites.items() if self.state_rule else ()):
                        flat[self._region_index[name]] = self.region_buffers[name][: numel(site.live_shape)].view(
                            site.live_shape)
                    self(*flat)
            finally:
                self._capturing = False
        return {"seconds": time.perf_counter() - t0,
                "classes": {name: dict(eng.classes) for name, eng in self.runners().items()}}

    @contextmanager
    def _preserved_state(self) -> Iterator[None]:
        # copies on the host: warm-up must not raise the device peak by the size of the state
        state = list(self.region_buffers.values()) + self._workspaces
        saved = {i: t.to("cpu", copy=True) for i, t in enumerate(state)}
        self._preserved_ptrs = frozenset(t.untyped_storage().data_ptr() for t in state)
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        counts = {k: v for k, v in self.stats.items() if isinstance(v, int)}  # warm-up is not traffic
        try:
            yield
        finally:
            for i, v in saved.items():
                state[i].copy_(v)
            self._preserved_ptrs = frozenset()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            self.stats.update(counts)

    # ------------------------------------------------------------------ introspection
    def region_pointer(self, name: str) -> int:
        """The data pointer every returned state view of region ``name`` starts at."""
        return self.region_buffers[name].data_ptr()

    def graph_modules(self) -> list[GraphModule]:
        return [gm for gm, _s, _c in self._programs.values()]


def optimize(exported: ExportedProgram | Sequence[ExportedProgram], contract: Contract, *,
             verify: bool = False, replay: Replay | Any = "auto", state: bool = True) -> OptimizedProgram:
    """Rewrite a streaming step under ``contract`` and return a drop-in replacement for ``ep.module()``.

    Args:
        exported: one ``torch.export`` program of the step, or one per catalog class (the extents
            ``cadence_fx.plan`` lists) when the step is exported with static shapes.
        contract: the native-clock contract.
        verify: shadow-run the stock concatenation at every carry append and retention and raise
            :class:`cadence_fx.audit.RetentionMismatch` on the first differing element.
        replay: ``"auto"`` replays wrapped partitions through CUDA graphs when CUDA is available
            (eager otherwise), ``"off"`` never replays, or a replay backend object.
        state: apply the state rule (contract-owned region buffers, in-place writeback). Off, the
            regions stay as the program allocates them: the single-rule cells of the factorial.
    """
    eps = [exported] if isinstance(exported, ExportedProgram) else list(exported)
    if not eps:
        raise ContractError("optimize: no exported program given")
    return OptimizedProgram(eps, contract, verify=verify, replay=replay, state=state)


def _pick_backend(replay: Replay | Any) -> Any:
    if replay == "off":
        return None
    if replay == "auto":
        from cadence_fx.replay import CudaGraphBackend

        backend = CudaGraphBackend()
        return backend if backend.available() else None
    return replay



def _arg_key(a: Any) -> tuple:
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype)
    return ("S", type(a).__name__)


def _key_of_program(ep: ExportedProgram) -> tuple:
    phs = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for name in input_names(ep):
        val = phs[name].meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append(("T", tuple(int(s) if isinstance(s, int) else s for s in val.shape), val.dtype))
        else:
            out.append(("S", type(val).__name__))
    return tuple(out)
