"""Envelope state: a history the program keeps in a workspace of its own becomes the region buffer.

A region whose clock axis is not outermost (``(steps, blocks, B, H, T, D)``) and whose outgoing value
is sliced from a module buffer (the stock solver writes each step's ``history + new`` frames into a
workspace, then the driver trims it) is stored in the envelope layout (``RegionPlan.layout``): the
buffer is the live shape with the clock axis at its longest in-flight extent, and a state of extent
``T`` is ``narrow(axis, 0, T)`` of it. The workspace then *is* the region buffer: its writes land
where the next call reads its state, and the trim (``retention_in_place``) keeps the head in place and
moves the tail toward it. One copy of the history instead of two.

Proved per program, else the workspace is kept and the reason reported (``left_stock``):

- every use of the workspace is bounded by slice chains, within the envelope (dims with dead stock
  capacity may be read past it only by the region's own outgoing value, which keeps the live slots);
- it is written only by ``copy_`` into such views, and every read sees only positions written earlier
  in the same call (so its bytes between calls, now the region's state, are never read);
- every read of the region input that overlaps a workspace write runs before that write;
- nothing but the region's own output returns a view of the workspace or the input;
- reads of both only move elements (cat, copy, clone, ...) or map them one by one (pointwise ops):
  the envelope's strides differ from a contiguous state's and from the stock workspace's, and only
  those are proved stride-independent (``analysis.boxes.stride_independent``).

Any region in the envelope layout whose input is read by anything else gets a contiguous copy of the
input for those readers (exact, at the cost of one copy of the state; reported).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from cadence_fx.annotations import CONTIGUOUS_INPUT_COPY, HISTORY_WORKSPACE_KEPT, is_state_attr
from cadence_fx.binding import RegionSite
from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.boxes import access_boxes, box_covered, leaf_consumers, reach, stride_independent
from cadence_fx.analysis.graph_io import fetch_attr, flat_outputs, flat_view
from cadence_fx.analysis.ops import aten, is_guard, is_mutating, is_view, is_view_op, overload_name
from cadence_fx.passes import PassContext, RegionState


def envelope_state(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Bind every envelope-layout region's view; merge the workspace its history lives in, when proved."""
    if not ctx.config.state_rule:
        return gm
    graph = gm.graph
    outs = flat_outputs(graph)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    merged = 0
    for name, site in ctx.program.sites.items():
        if site.envelope is None:
            continue
        state = ctx.program.regions[name]
        if state.envelope is None:
            with graph.inserting_before(first):
                buf = graph.get_attr(state.buffer_attr)
                state.envelope = flat_view(graph, buf, 0, site.envelope)
            value = outs[site.region.output % len(outs)]
            reason = _merge(gm, site, state, value)
            if reason is None:
                merged += 1
            elif reason != _NO_WORKSPACE:  # an appended context has no workspace to merge: nothing was kept
                ctx.program.leave_stock(HISTORY_WORKSPACE_KEPT, name, reason)
        # else: carry_writeback appended in the envelope already (its cat is the whole buffer)
        stride_bound = [u for u in state.placeholder.users
                        if not is_guard(u) and not _moves_only(u, state.placeholder)]
        if stride_bound:
            with graph.inserting_after(state.placeholder):
                dense = graph.call_function(aten.clone.default, (state.placeholder,),
                                            {"memory_format": torch.contiguous_format})
            for u in stride_bound:
                u.replace_input_with(state.placeholder, dense)
            ctx.program.leave_stock(CONTIGUOUS_INPUT_COPY, name, f"input read by {stride_bound[0].name} "
                                    f"({overload_name(stride_bound[0])}), which may depend on strides")
    ctx.record("envelope_state", merged)
    return gm


_NO_WORKSPACE = "the outgoing value is not sliced from one module buffer"


def _merge(gm: GraphModule, site: RegionSite, state: RegionState, value: object) -> str | None:
    """Replace the workspace the region's value is sliced from by the envelope view; None when done,
    else why not (nothing is changed then)."""
    graph = gm.graph
    env = site.envelope
    parts = value.args[0] if isinstance(value, Node) and overload_name(value) == "cat" else [value]
    roots = {view_root(p) for p in parts}
    root = roots.pop() if len(roots) == 1 else None
    if not isinstance(root, Node) or root.op != "get_attr" or is_state_attr(root.target):
        return _NO_WORKSPACE
    tensor = fetch_attr(gm, str(root.target))
    buf = fetch_attr(gm, state.buffer_attr)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != len(env) or tensor.dtype != site.dtype \
            or tensor.device != buf.device:
        return "the buffer's rank, dtype or device is not the region's"
    uses = graph.find_nodes(op="get_attr", target=root.target)
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = graph.output_node()
    own = {value} | {p for p in parts if isinstance(p, Node)}
    live = dict(site.live)
    writes: list[tuple[int, list[tuple[int, int]]]] = []
    reads: list[tuple[Node, list[tuple[int, int]]]] = []
    for u in uses:
        found = access_boxes(u, tuple(tensor.shape))
        if found is None:
            return "a use of the workspace escapes slicing"
        for user, view, box in found:
            if overload_name(user) == "copy_" and user.args[0] is view:
                if any(e > env[d] for d, (_s, e) in enumerate(box)):
                    return f"{user.name} writes past the envelope {env}"
                if view_root(user.args[1]) in uses:
                    return f"{user.name} copies the workspace into itself"
                writes.append((order[user], box))
                continue
            if is_mutating(user) and user.args and user.args[0] is view:
                return f"{user.name} ({overload_name(user)}) writes the workspace other than by a copy"
            clipped = [(s, min(e, env[d])) if d in live else (s, e) for d, (s, e) in enumerate(box)]
            if clipped != box and user not in own and user is not out:
                return f"{user.name} reads dead capacity of the workspace"
            if any(e > env[d] for d, (_s, e) in enumerate(clipped)):
                return f"{user.name} reads past the envelope {env}"
            reads.append((user, view, clipped))
    # every read sees only this call's writes: the workspace's bytes between calls are the state now
    for user, view, box in reads:
        consumers = leaf_consumers(user)
        if not all(stride_independent(c, view) or c is out for c in consumers):
            return f"a read of the workspace ({view.name}) does more than move data"
        first_read = min(order[c] for c in consumers) if consumers else len(order)
        if not box_covered(box, [b for o, b in writes if o < first_read]):
            return f"{view.name} reads positions of the workspace this call has not written before it"
    # the input: read (only moved) before any write that overlaps what it reads
    found = access_boxes(state.placeholder, site.shape)
    if found is None:
        return "a use of the region input escapes slicing"
    for user, view, box in found:
        if is_mutating(user) and user.args and user.args[0] is view:
            return f"{user.name} writes the region input in place"
        consumers = [c for c in leaf_consumers(user) if not is_guard(c)]
        if any(c is out for c in consumers):
            return "the region input is returned"
        last = max((order[c] for c in consumers), default=-1)
        for o, wbox in writes:
            overlap = all(max(s, ws) < min(e, we) for (s, e), (ws, we) in zip(box, wbox))
            if overlap and last > o:
                return f"the region input ({view.name}) is read after a workspace write overwrites it"
    # no other output is a view of the workspace or of the input
    roots_of = set(uses) | {state.placeholder}
    outs = flat_outputs(graph)
    for i, v in enumerate(outs):
        if i != site.region.output % len(outs) and isinstance(v, Node) and view_root(v) in roots_of:
            return f"output {i} is a view of the workspace or the region input"
    # proved: indices count from the envelope's ends now, so make them non-negative first
    bounded = reach(uses, tuple(tensor.shape))
    if bounded is None:
        return "a use of the workspace escapes slicing"
    for n, args in bounded[1]:
        n.args = args
    for u in uses:
        u.replace_all_uses_with(state.envelope)
        graph.erase_node(u)
    _refresh_values(graph, state.envelope, site, buf)
    owner_path, _, leaf = str(root.target).rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    owner._buffers.pop(leaf, None)  # nothing here keeps the stock workspace alive
    return None


def _moves_only(user: Node, placeholder: Node) -> bool:
    """Whether ``user`` of the region input only moves its elements (through views)."""
    view = user if is_view_op(user) else placeholder
    return all(stride_independent(c, view) for c in leaf_consumers(user))


def _refresh_values(graph, envelope: Node, site: RegionSite, buf: torch.Tensor) -> None:
    """Recompute the recorded values (shapes) of the views now cut from the envelope, and of the cats
    and outputs they feed: dims with dead stock capacity now hold the live slots only."""
    proto = next((n.meta["val"] for n in graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor)), None)
    mode = getattr(proto, "fake_mode", None)
    if mode is None:
        return
    with mode:
        envelope.meta["val"] = torch.empty(site.envelope, dtype=buf.dtype, device=buf.device)
    stack = list(envelope.users)
    seen = set()
    while stack:
        n = stack.pop(0)
        if n in seen or not (is_view(n) or overload_name(n) == "cat") \
                or any(a.meta.get("val") is None for a in n.all_input_nodes):
            continue
        seen.add(n)
        args = torch.fx.node.map_arg(n.args, lambda a: a.meta.get("val"))
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: a.meta.get("val"))
        try:
            with mode:
                n.meta["val"] = n.target(*args, **kwargs)
        except Exception:  # an op fake tensors cannot run: drop the stale value
            n.meta.pop("val", None)
            continue
        stack.extend(n.users)
