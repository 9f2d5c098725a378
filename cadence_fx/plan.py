"""What a contract implies before any traffic: extents, bytes and the signature catalog.

Paper section 3.5: a region whose extent starts at ``initial``, grows by a fixed
stride and is cut by its retention policy visits a finite set of extents
before the policy pins it. Those extents, per call, are the exact signature
classes to capture; nothing else can reach the step under the contract.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from cadence_fx.binding import RegionSite, bind_regions
from cadence_fx.contract import Contract, ContractError, HeadTail, Region, Ring
from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.graph_io import fetch_attr, flat_outputs
from cadence_fx.analysis.ops import overload_name


def region_extents(region: Region, growth: int, *, max_calls: int = 10_000) -> list[int]:
    """Input extents the region takes, call after call, until the retention policy pins it."""
    pol = region.retention
    t = region.initial  # a Ring starts empty (0) or full; after one call it is full
    seen: list[int] = []
    for _ in range(max_calls):
        if t in seen:
            return seen
        seen.append(t)
        t = pol.apply(t + growth)
    raise ContractError(f"Region {region.name!r}: extent never settles under {pol!r} "
                        f"(growth {growth}); the retention is unbounded in effect")


def call_classes(contract: Contract, *, max_calls: int = 10_000) -> list[dict[str, int]]:
    """Distinct per-call region extents (one dict per class), in stream order, until every region is pinned."""
    per = {r.name: region_extents(r, contract.growth(r), max_calls=max_calls) for r in contract.regions}
    classes: list[dict[str, int]] = []
    k = 0
    while True:
        cls = {name: ext[min(k, len(ext) - 1)] for name, ext in per.items()}
        if cls in classes:
            return classes
        classes.append(cls)
        k += 1


@dataclass(frozen=True)
class RegionPlan:
    """The derived facts for one region (see :func:`plan`)."""

    name: str
    order: str | None  # None: a Ring the model writes in place
    retention: str
    extents: tuple[int, ...]  # catalog: input extents visited
    attended: int  # longest history a consumer reads (the carry)
    envelope: int  # longest in-flight extent (history + new positions before retention)
    leading: bool  # clock axis is outermost (in-place append possible)
    stored: int  # extent the contract-owned buffer is sized to
    stored_shape: tuple[int, ...]
    stored_bytes: int
    static_source: str | None  # the workspace the program itself allocates for this region
    static_shape: tuple[int, ...] | None
    static_bytes: int | None
    demand_shape: tuple[int, ...] | None
    demand_bytes: int | None
    # "prefix": the state is the contiguous front of the buffer; "envelope": the buffer is
    # ``stored_shape`` and a state of extent T is ``narrow(axis, 0, T)`` of it, so the program's own
    # workspace for the region's history can be the region buffer (``passes.envelope_state``)
    layout: str = "prefix"
    axis: int = 0

    @property
    def session_shape(self) -> tuple[int, ...]:
        """The shape a session's own buffer stores (states between calls, always the contiguous prefix)."""
        if self.layout != "envelope":
            return self.stored_shape
        out = list(self.stored_shape)
        out[self.axis] = self.attended
        return tuple(out)

    @property
    def session_bytes(self) -> int:
        """Bytes of a session's own buffer for this region (:attr:`session_shape`)."""
        return self.stored_bytes // max(math.prod(self.stored_shape), 1) * math.prod(self.session_shape)

    @property
    def over_reservation(self) -> float | None:
        if self.static_bytes is None or not self.demand_bytes:
            return None
        return self.static_bytes / self.demand_bytes


@dataclass(frozen=True)
class Plan:
    """Everything :func:`cadence_fx.optimize` will allocate and capture, derived from the contract."""

    regions: tuple[RegionPlan, ...]
    classes: tuple[dict[str, int], ...]
    wrap: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    def region(self, name: str) -> RegionPlan:
        return next(r for r in self.regions if r.name == name)

    def __str__(self) -> str:
        lines = ["cadence_fx plan", ""]
        hdr = f"{'region':<22}{'order':<9}{'retention':<30}{'attended':>9}{'envelope':>9}{'stored':>8}{'MiB':>9}"
        lines += [hdr, "-" * len(hdr)]
        for r in self.regions:
            lines.append(f"{r.name:<22}{(r.order or 'in place'):<9}{r.retention:<30}{r.attended:>9}{r.envelope:>9}"
                         f"{r.stored:>8}{r.stored_bytes / 2**20:>9.2f}"
                         + ("  (envelope layout: the buffer holds the longest in-flight extent)"
                            if r.layout == "envelope" else ""))
        lines += ["", "static envelope the program allocates vs. contract demand:"]
        for r in self.regions:
            if r.static_shape is None:
                lines.append(f"  {r.name}: no program-owned workspace (fresh tensors every call)")
                continue
            lines.append(f"  {r.name}: {r.static_source} {tuple(r.static_shape)} = {r.static_bytes / 2**20:.1f} MiB"
                         f"  vs demand {tuple(r.demand_shape)} = {r.demand_bytes / 2**20:.1f} MiB"
                         f"  -> {r.over_reservation:.2f}x over-reserved")
        lines += ["", f"catalog: {len(self.classes)} signature class(es) per wrapped callable"
                  f" ({', '.join(self.wrap) or 'no wrapped callables'})"]
        for i, c in enumerate(self.classes):
            lines.append(f"  class {i}: " + ", ".join(f"{k}={v}" for k, v in c.items()))
        for r in self.regions:
            lines.append(f"  {r.name} extents: {list(r.extents)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _workspace_of(node: object) -> Node | None:
    """The buffer (placeholder) a region output is a view of, if it is one."""
    root = view_root(node)
    return root if root is not None and root.op in ("get_attr", "placeholder") else None


def _history_workspace(value: object, site: RegionSite, buffers: dict[str, str]) -> Node | None:
    """The module buffer the region's outgoing value is sliced from along the clock axis (the trim's
    operands, or the value itself), when it is one buffer of the region's rank and dtype. Views made
    inside an autocast or grad-mode block (a higher-order op the pipeline inlines) are followed in."""
    if not isinstance(value, Node):
        return None
    parts = value.args[0] if overload_name(value) == "cat" else [value]
    roots = {_view_root_through_blocks(p) for p in parts if isinstance(p, Node)}
    if len(roots) != 1:
        return None
    root = roots.pop()
    if root is None or root.op != "placeholder" or root.name not in buffers:
        return None
    val = root.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != len(site.shape) or val.dtype != site.dtype:
        return None
    return root


def _view_root_through_blocks(node: Node) -> Node | None:
    """``view_root``, continued through an output of a higher-order block (``wrap_with_autocast``,
    ``wrap_with_set_grad_enabled``) that is a view of one of the block's operands."""
    root = view_root(node)
    while root is not None and root.op == "call_function" and root.target is operator.getitem \
            and isinstance(root.args[0], Node) and isinstance(root.args[1], int):
        call = root.args[0]
        k = next((i for i, a in enumerate(call.args) if isinstance(a, Node) and a.op == "get_attr"), None)
        sub = fetch_attr(call.graph.owning_module, str(call.args[k].target)) if k is not None else None
        if not isinstance(sub, torch.fx.GraphModule):
            return root
        outs = flat_outputs(sub.graph)
        inner = view_root(outs[root.args[1]]) if root.args[1] < len(outs) else None
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if inner is None or inner not in phs:
            return root
        operand = call.args[k + 1 + phs.index(inner)] if k + 1 + phs.index(inner) < len(call.args) else None
        if not isinstance(operand, Node):
            return root
        root = view_root(operand)
    return root


def _only_appended(ep: ExportedProgram, name: str, axis: int) -> bool:
    """Whether input ``name``'s one use is a cat along ``axis`` that takes it, or a slice of it along the
    axis, first (``cat([ctx, new])``, ``cat([ctx[..., s:], new])``)."""
    ph = next((n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name), None)
    users = list(ph.users) if ph is not None else []
    if len(users) != 1:
        return False
    rank = ph.meta["val"].dim()
    head = ph
    if users[0].target is torch.ops.aten.slice.Tensor and len(users[0].users) == 1:  # cat([ctx[..., s:], new])
        sl = users[0]
        if (sl.args[1] if len(sl.args) > 1 else 0) % rank != axis or (len(sl.args) > 4 and sl.args[4] != 1):
            return False
        head, users = sl, list(sl.users)
    if users[0].target is not torch.ops.aten.cat.default:
        return False
    cat = users[0]
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return len(parts) > 1 and parts[0] is head and head not in parts[1:] and dim % rank == axis


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize  # bool and complex too (iinfo/finfo refuse them)



def plan(exported: ExportedProgram | Sequence[ExportedProgram], contract: Contract) -> Plan:
    """Derive per-region extents, bytes, the static envelope and the signature catalog.

    ``exported`` may be one program or one per catalog class; the first is used for shapes.
    """
    ep = exported if isinstance(exported, ExportedProgram) else list(exported)[0]
    sites = bind_regions(ep, contract)
    out_node = ep.graph.output_node()
    user_outs = list(ep.graph_signature.user_outputs)
    by_name = {a.name: a for a in out_node.args[0] if isinstance(a, Node)}
    buffers = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs
               if spec.target is not None and hasattr(spec.arg, "name")}
    regions: list[RegionPlan] = []
    for r in contract.regions:
        site: RegionSite = sites[r.name]
        g = contract.growth(r)
        ext = region_extents(r, g)
        attended = max(ext)
        envelope = attended if isinstance(r.retention, Ring) else max(e + g for e in ext)
        leading = all(s == 1 for s in site.shape[: site.axis])
        value = by_name.get(user_outs[r.output])
        # a non-leading history the program keeps in a workspace of its own (written, then trimmed into
        # the output): store the region in the envelope layout, so that workspace can be the region
        history = _history_workspace(value, site, buffers) if not leading and not isinstance(r.retention, Ring) \
            else None
        # a non-leading context the model appends to (a conv's left context ``cat([ctx, x], -1)``): in the
        # envelope layout the cat of the longest class is the whole buffer, so the append is in place
        append = not leading and history is None and r.order == "old_new" and not r.live \
            and _only_appended(ep, r.input, site.axis)
        layout = "envelope" if history is not None or append else "prefix"
        stored = envelope if leading or layout == "envelope" else attended
        stored_shape = _with(site.shape, site.axis, stored, r.live)
        src = _workspace_of(value) if history is None else history
        static_shape = static_bytes = demand_shape = demand_bytes = None
        static_source = None
        if src is not None and src.op == "placeholder" and src.name in buffers:
            sval = src.meta["val"]
            if sval.dim() == len(site.shape):
                static_source = buffers[src.name]
                static_shape = tuple(int(s) for s in sval.shape)
                static_bytes = _nbytes(static_shape, sval.dtype)
                demand_shape = _with(static_shape, site.axis, envelope, r.live)
                demand_bytes = _nbytes(demand_shape, sval.dtype)
        regions.append(RegionPlan(
            name=r.name, order=r.order, retention=repr(r.retention), extents=tuple(ext),
            attended=attended, envelope=envelope, leading=leading, stored=stored,
            stored_shape=stored_shape, stored_bytes=_nbytes(stored_shape, site.dtype),
            static_source=static_source, static_shape=static_shape, static_bytes=static_bytes,
            demand_shape=demand_shape, demand_bytes=demand_bytes, layout=layout, axis=site.axis))
    notes = []
    if any(r.live for r in contract.regions):
        notes.append("live dims: the region buffer and the returned state hold only the live slots; "
                     "the dead capacity the stock program carries is not stored")
    if any(isinstance(r.retention, HeadTail) for r in contract.regions):
        notes.append("HeadTail keeps [:head] and [-tail:] of the concatenated axis in the model's own order")
    return Plan(tuple(regions), tuple(call_classes(contract)), tuple(contract.wrap), tuple(notes))


def state_traffic(program) -> list[dict]:
    """Per catalog class of an optimized program, the state bytes one call writes per region.

    ``[{"class": {region: extent}, "regions": {region: {"stock": b, "optimized": b}}, "left_stock": [...]}]``:
    ``stock`` for the unmodified program, ``optimized`` for the rewritten one, both counted from the graphs
    by :func:`cadence_fx.analysis.traffic.state_bytes_written` (data movement into the outgoing state: the
    bytes a cat, a functional index_copy or a copy into the region buffer writes; not the arithmetic that
    computes the new positions); ``None`` where a value on the way could not be sized (logged when
    optimized). ``left_stock`` lists the state patterns a pass could not prove exact
    (:class:`~cadence_fx.annotations.Finding` records; ``str()`` of one is its sentence).
    """
    out = []
    for _key, entry in program.catalog.items():
        out.append({"class": {n: s.extent for n, s in entry.sites.items()},
                    "regions": {n: dict(v) for n, v in entry.facts.state_bytes.items()},
                    "left_stock": list(entry.facts.left_stock)})
    return out


def format_traffic(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`state_traffic`'s rows as the table ``cadence-fx plan --traffic`` prints: per class and
    region, the bytes one call moves into the outgoing state, stock and optimized, and what the passes
    did or why they could not."""
    width = max([len(", ".join(f"{k}={v}" for k, v in row["class"].items())) for row in rows] + [5]) + 2
    hdr = f"{'class':<{width}}{'region':<22}{'stock B':>10}{'optimized B':>13}  rewrite"
    lines = ["state traffic per call (bytes moved to build each region's outgoing state)", "", hdr, "-" * len(hdr)]
    for row in rows:
        cls = ", ".join(f"{k}={v}" for k, v in row["class"].items())
        for region, counts in row["regions"].items():
            stock, opt = counts.get("stock"), counts.get("optimized")
            notes = [f.reason for f in row["left_stock"] if f.subject == region]
            how = "; ".join(notes) if notes else ("below stock" if stock is not None and opt is not None and opt < stock
                                                    else "equal to stock")
            lines.append(f"{cls:<{width}}{region:<22}{_b(stock):>10}{_b(opt):>13}  {how}")
    return "\n".join(lines)


def _b(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _with(shape: Sequence[int], axis: int, extent: int, live: dict[int, int] | object) -> tuple[int, ...]:
    out = list(shape)
    out[axis] = extent
    for d, n in dict(live).items():
        out[d % len(out)] = min(out[d % len(out)], n)
    return tuple(out)
