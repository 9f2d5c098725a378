"""Retention in place: the region's outgoing value is written into its own buffer.

The stock trim ``cat([x[:P], x[-R:]])`` (or the sliding window ``x[-W:]``)
becomes copies into the contract-owned buffer: a part already at its place is
not copied (the head of an in-place carry), a part that overlaps its
destination is staged through a temporary first, everything else is copied
once. The returned state is a view of the buffer, so the next call sees the
same address. The trim found in the graph is checked against the declared
policy for this program's extents; a mismatch is an error naming the region.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from cadence_fx.annotations import STATE_COPIED, STATE_REPLACED, TRAFFIC_ABOVE_STOCK, is_region_attr
from cadence_fx.runtime.audit import audit, auditor_node
from cadence_fx.binding import RegionSite
from cadence_fx.analysis.aliases import view_root, written_in_place
from cadence_fx.analysis.graph_io import flat_outputs, flat_view, numel, set_flat_output
from cadence_fx.analysis.retained import NotSlices, Part, retained_parts, whole_part
from cadence_fx.analysis.ops import aten, is_mutating, is_view, overload_name
from cadence_fx.passes import PassContext
from cadence_fx.passes.carry_writeback import record_state_bytes


def retention_in_place(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write each region's outgoing state into its buffer (compacting in place); check the trim policy."""
    if not ctx.config.state_rule:
        return gm
    graph = gm.graph
    out = graph.output_node()
    outs = flat_outputs(graph)
    region_out_idx = {site.region.output % len(outs) for site in ctx.program.sites.values()}
    buffers = {n for n in graph.find_nodes(op="get_attr") if is_region_attr(n.target)}
    aliased_roots = buffers | {s.placeholder for s in ctx.program.regions.values()}
    copies = 0
    written_direct = 0
    writers = _writers(graph)
    with graph.inserting_before(out):
        # outputs that are views of a region must be read before the region is rewritten
        for i, v in enumerate(outs):
            if i not in region_out_idx and isinstance(v, Node) and view_root(v) in aliased_roots:
                set_flat_output(graph, i, graph.call_function(aten.clone.default, (v,)))
        # Phase 1, before any region is written: what each region keeps, staged where it reads any
        # region's storage (its own, or another's: one region's new state may be built from another's).
        plans = []
        for name, site in ctx.program.sites.items():
            state = ctx.program.regions[name]
            value = outs[site.region.output % len(outs)]
            # the input, or the region's buffer (an in-place append reads its history there)
            sources = {state.placeholder} | set(graph.find_nodes(op="get_attr", target=state.buffer_attr))
            growth = ctx.contract.growth(site.region)
            if site.extent > 0 and isinstance(value, Node) and not _depends_on(value, sources, writers):
                # the state is replaced whole (the tail of the new input, a class that ignores the old
                # state): nothing of the old one is kept, so there is nothing to keep in place
                ctx.program.leave_stock(STATE_REPLACED, name, f"output {site.region.output} is not computed from "
                                        f"input {site.region.input!r} (its new value does not read the old one)")
                parts = [whole_part(value, site, growth)]
            else:
                try:
                    parts = retained_parts(value, site, growth)
                except NotSlices as e:
                    ctx.program.leave_stock(STATE_COPIED, name, str(e))
                    parts = [whole_part(value, site, growth)]
            staged: list[tuple[Part, Node]] = []
            for p in parts:
                # the input itself, or the input written in place (a ring's index_copy_/scatter_, a slice
                # assignment): the bytes are already in the region buffer the input is a view of
                in_place = written_in_place(p.src) is state.placeholder and site.out_shape == site.shape \
                    and not site.live
                in_place |= p.base is state.carry and state.carry is not None and p.src_offset == p.dst_offset
                origin = _envelope_offset(p.base, state, site.axis)
                in_place |= origin is not None and p.src_offset is not None and origin + p.src_offset == p.dst_offset
                if in_place:
                    continue
                if _shift_in_place(p, site, state):  # moved within the buffer in Phase 2, chunk by chunk
                    staged.append((p, None))
                    continue
                src = p.src
                for d, n in site.live:  # dead stock capacity is not part of the state
                    src = graph.call_function(aten.narrow.default, (src, d, 0, n))
                if view_root(p.src) in aliased_roots:
                    src = graph.call_function(aten.clone.default, (src,))  # overlapping move: stage it
                staged.append((p, src))
            expected = None
            if ctx.config.verify:  # the stock value, read before the compaction rewrites what it views
                expected = value
                for d, n in site.live:
                    expected = graph.call_function(aten.narrow.default, (expected, d, 0, n))
                expected = graph.call_function(aten.clone.default, (expected,))
            plans.append((name, site, state, staged, expected))
        # Phase 2: the writes.
        for name, site, state, staged, expected in plans:
            buf = graph.get_attr(state.buffer_attr)
            out_shape = site.live_out_shape
            if state.envelope is not None:  # the state is the envelope's front on the clock axis
                dst = graph.call_function(aten.narrow.default, (state.envelope, site.axis, 0, out_shape[site.axis]))
            else:
                dst = flat_view(graph, buf, 0, out_shape)
            inner = numel(out_shape[site.axis + 1:])
            leading = all(s == 1 for s in out_shape[: site.axis])
            for p, src in staged:
                if src is None:
                    if state.envelope is None:  # the flat buffer: positions x inner size
                        copies += _shift(graph, buf, 0, p.src_offset * inner, p.dst_offset * inner, p.length * inner,
                                         shift=(p.src_offset - p.dst_offset) * inner)
                    else:  # the envelope, along the clock axis
                        src0 = _envelope_offset(p.base, state, site.axis) + p.src_offset
                        copies += _shift(graph, state.envelope, site.axis, src0, p.dst_offset, p.length,
                                         shift=src0 - p.dst_offset)
                    continue
                if len(staged) == 1 and _compute_into(graph, src, state, site, writers):
                    written_direct += 1
                    continue
                pshape = list(out_shape)
                pshape[site.axis] = p.length
                if leading:
                    target = flat_view(graph, buf, p.dst_offset * inner, pshape)
                else:
                    target = graph.call_function(aten.slice.Tensor, (dst, site.axis, p.dst_offset,
                                                                     p.dst_offset + p.length))
                graph.call_function(aten.copy_.default, (target, src))
                copies += 1
            if expected is not None:
                graph.call_function(audit, (auditor_node(gm, ctx.config.auditor), name, "retention", dst, expected))
            set_flat_output(graph, site.region.output % len(outs), dst)
    graph.eliminate_dead_code()
    record_state_bytes(gm, ctx, "optimized")
    _report_above_stock(ctx)
    ctx.record("retention_in_place", copies)
    ctx.record("computed_into_region", written_direct)
    return gm


def _report_above_stock(ctx: PassContext) -> None:
    """Say so wherever the rewritten program moves more state bytes per call than the stock one.

    The usual cause: the stock state is a view of a tensor the program allocates anew every call (the
    cat the model also reads, a slice of the new input), which costs the stock program nothing more,
    while a buffer at a stable address takes one copy of it."""
    for name, counts in ctx.program.state_bytes.items():
        stock, optimized = counts.get("stock"), counts.get("optimized")
        if stock is None or optimized is None or optimized <= stock:
            continue
        why = [f.reason for f in ctx.program.left_stock if f.subject == name]
        ctx.program.leave_stock(TRAFFIC_ABOVE_STOCK, name, f"{optimized} B of state moved per call against the stock "
                                f"program's {stock} B (" + ("; ".join(why) if why else
                                "the stock state is a view of a tensor allocated anew each call; a stable buffer "
                                "takes one copy of it") + ")")


def _compute_into(graph, src: Node, state, site: RegionSite, writers: dict[Node, list[Node]]) -> bool:
    """Compute a region's whole outgoing value straight into its buffer, instead of into a new tensor that
    is then copied there: an elementwise op (a counter's ``torch.where(mask, offsets + T, offsets)``)
    becomes its ``out=`` form writing a view of the buffer, in its own place in the graph, and its users
    read that view. Same kernel, same elements in the same order, so the same bits; one copy fewer.

    Only when nothing reads the region's old bytes after the op (the op itself may: an elementwise
    kernel allows its output to overlap an input exactly, and the region input is the same view of the
    buffer), nothing writes them before it, and its shape and dtype are the region's. Returns whether
    it did.
    """
    op = src.target
    if src.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags:
        return False
    if site.live or site.envelope is not None or tuple(site.out_shape) != tuple(site.shape) \
            or state.placeholder in writers:
        return False
    # returned elsewhere too, or a view of it (a plain output besides the state): that output must stay a
    # fresh tensor, not a view of the buffer the next call overwrites
    outs = flat_outputs(graph)
    if any(isinstance(v, Node) and view_root(v) is src for i, v in enumerate(outs)
           if i != site.region.output % len(outs)):
        return False
    val = src.meta.get("val")
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(site.out_shape) or val.dtype != site.dtype \
            or not val.is_contiguous():
        return False
    region = {state.placeholder} | set(graph.find_nodes(op="get_attr", target=state.buffer_attr))
    for a in src.all_input_nodes:  # what it reads of the region is the input itself (an exact overlap)
        if view_root(a) in region and a is not state.placeholder:
            return False
    after = False
    for n in graph.nodes:  # nothing reads the old bytes once the op has written them
        if n is src:
            after = True
            continue
        if after and not is_view(n) and any(view_root(a) in region for a in n.all_input_nodes):
            return False
    out_op = _out_overload(op)
    if out_op is None:
        return False
    with graph.inserting_before(src):
        buf = graph.get_attr(state.buffer_attr)
        dst = flat_view(graph, buf, 0, site.out_shape)
        computed = graph.call_function(out_op, src.args, {**src.kwargs, "out": dst})
    # the new nodes belong where src did (its wrapped invocation: one partition, not two)
    n = buf
    while n is not src:
        n.meta = dict(src.meta) if n is computed else {k: v for k, v in src.meta.items() if k != "val"}
        n = n.next
    src.replace_all_uses_with(computed)
    graph.erase_node(src)
    return True


def _out_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The ``out=`` overload of ``op``: same arguments, plus the one it writes."""
    args = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in op.overloadpacket.overloads():
        cand = getattr(op.overloadpacket, name)
        cargs = cand._schema.arguments
        if cargs and cargs[-1].name == "out" and cargs[-1].kwarg_only \
                and [(a.name, str(a.type)) for a in cargs[:-1]] == args:
            return cand
    return None


# A compaction that moves a part toward the front of its own buffer by ``shift`` positions is done as
# copies of at most ``shift`` positions each, front first: each reads positions no earlier copy wrote
# and writes none it reads, so no staging copy is needed and the call writes the part's bytes once
# (the stock cat + slice writes them once too). Past this many copies, staging (two passes) is used.
_MAX_SHIFT_COPIES = 16


def _shift_in_place(p: Part, site: RegionSite, state) -> bool:
    """Whether part ``p`` is a slice of the region's own in-place carry moved toward the buffer front
    along an outermost clock axis (flat offsets are positions x inner size), or a slice of the envelope
    moved toward its front along the clock axis, in few enough copies."""
    origin = _envelope_offset(p.base, state, site.axis)
    if origin is not None and p.src_offset is not None:
        shift = origin + p.src_offset - p.dst_offset
        return shift > 0 and -(-p.length // shift) <= _MAX_SHIFT_COPIES
    if state.carry is None or p.base is not state.carry or site.live or p.src_offset is None:
        return False
    shift = p.src_offset - p.dst_offset
    leading = all(s == 1 for s in site.out_shape[: site.axis])
    return leading and shift > 0 and -(-p.length // shift) <= _MAX_SHIFT_COPIES


def _shift(graph, base: Node, dim: int, src: int, dst: int, length: int, *, shift: int) -> int:
    """Emit the chunked move of ``length`` positions of ``base`` along ``dim`` from ``src`` to ``dst``
    (``dst < src``), in copies of at most ``shift`` positions, front first."""
    n = 0
    for k in range(0, length, shift):
        c = min(shift, length - k)
        to = graph.call_function(aten.slice.Tensor, (base, dim, dst + k, dst + k + c))
        frm = graph.call_function(aten.slice.Tensor, (base, dim, src + k, src + k + c))
        graph.call_function(aten.copy_.default, (to, frm))
        n += 1
    return n


def _envelope_offset(node: object, state, axis: int) -> int | None:
    """Where ``node`` starts on the clock axis of the region's envelope view, when it is that view or a
    slice of it along the axis (what the envelope_state pass leaves the history as); else None."""
    if state.envelope is None or not isinstance(node, Node):
        return None
    if node is state.envelope:
        return 0
    if overload_name(node) == "narrow" and node.args[0] is state.envelope and not node.kwargs:
        dim, start = node.args[1], node.args[2]
        return start if dim == axis and isinstance(start, int) and start >= 0 else None
    if overload_name(node) == "slice" and node.args[0] is state.envelope and not node.kwargs:
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        if dim == axis and step == 1 and isinstance(start, int) and start >= 0:
            return start
    return None


def _writers(graph) -> dict[Node, list[Node]]:
    """For each storage root, the in-place ops that write it (FX edges do not show those dependencies)."""
    out: dict[Node, list[Node]] = {}
    for n in graph.nodes:
        if is_mutating(n) and n.args and isinstance(n.args[0], Node):
            out.setdefault(view_root(n.args[0]), []).append(n)
    return out


def _depends_on(value: Node, sources: set[Node], writers: dict[Node, list[Node]]) -> bool:
    """Whether ``value`` reads any of ``sources``: through its inputs, and through writes into what it views."""
    seen: set[Node] = set()
    stack = [value]
    while stack:
        n = stack.pop()
        if n in sources:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
        root = view_root(n)
        if root is not None:
            stack.extend(writers.get(root, ()))
    return False
