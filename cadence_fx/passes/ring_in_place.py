"""Ring in place: a functional update of the whole region becomes an in-place write of its new positions.

A ring the model updates out of place, ``new = cache.index_copy(axis, (pos + arange(n)) % C, frames)``
(or ``scatter``, ``index_put``, ``index_fill``, ``slice_scatter``, ``select_scatter``, a ``clone`` then
an in-place write, or the in-place form after ``run_decompositions``, which becomes the functional op
plus a ``copy_`` of the whole result back into the input), builds a new full cache every call; the
region writeback then copied that whole cache into the region buffer. ATen computes each of these
ops as "copy ``self``, then the in-place op on the copy", so running the in-place op on the region
input (a view of the region buffer) leaves the same bits where the copy would have been, and the
whole-cache copy, the allocation and the writeback copy disappear: the call writes only the
positions the index names, wrapping included (the index is data, not rewritten).

That is exact only when nothing still needs the old values once the write happens. For each link of
the chain from the region input to the region output, every other use of the storage it overwrites
(through views and in-place writes) must run before it, no other argument of the write may view
that storage, no output may view it, and the result must have the input's shape and strides.
A chain that fails any of these is left stock and reported (``ProgramFacts.left_stock``).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from cadence_fx.annotations import RING_UPDATE_KEPT
from cadence_fx.runtime.audit import audit, auditor_node
from cadence_fx.analysis.aliases import storage_root, written_in_place
from cadence_fx.analysis.graph_io import shape_of
from cadence_fx.analysis.ops import aten, is_mutating, is_view, overload_name
from cadence_fx.passes import PassContext

# functional ops computed by ATen as clone(self) + their in-place twin, with that twin's arguments
_WITH_TWIN = {"index_copy", "scatter", "index_put", "index_fill"}
# functional slice/select assignment: clone(self), then a view of it copied into
_SCATTER_VIEW = {"slice_scatter": aten.slice.Tensor, "select_scatter": aten.select.int}


def ring_in_place(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Rewrite each region's functional whole-region update into an in-place write of its buffer."""
    if not ctx.config.state_rule:
        return gm
    graph = gm.graph
    outs = graph.output_node().args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    changed = 0
    for name, site in ctx.program.sites.items():
        ph = ctx.program.regions[name].placeholder
        value = outs[site.region.output % len(outs)]
        found = _chain(value, ph)
        if found is None:
            continue  # not a whole-region update (a cat, a trim, already in place): other passes own it
        epilogue, links = found
        if not links or site.live or site.out_shape != site.shape:
            continue
        why = _unprovable(graph, ph, epilogue, links)
        if why is not None:
            ctx.program.leave_stock(RING_UPDATE_KEPT, name, why)
            continue
        _rewrite(gm, ctx, name, ph, epilogue, links)
        changed += len(links) + (epilogue is not None)
    graph.eliminate_dead_code()
    ctx.record("ring_in_place", changed)
    return gm


def _functional(node: Node) -> bool:
    name = overload_name(node)
    if name in _SCATTER_VIEW:
        return True
    return name in _WITH_TWIN and not is_mutating(node) and _twin(node) is not None


def _twin(node: Node):
    packet = getattr(aten, overload_name(node) + "_", None)
    return getattr(packet, node.target._overloadname, None) if packet is not None else None


def _chain(value: object, ph: Node) -> tuple[Node | None, list[Node]] | None:
    """``(epilogue copy_, links)`` from the region output back to its input, links output-first.

    A link is a functional update or a ``clone`` whose result the next link (or the output) takes
    whole; in-place writes on a link's result (``clone`` then ``index_put_``) belong to it. None when
    the output is not the region input updated whole this way.
    """
    epilogue = None
    if isinstance(value, Node) and value.target is aten.copy_.default and value.args[0] is ph:
        epilogue, value = value, value.args[1]  # the decomposed in-place form: the result copied back whole
    links: list[Node] = []
    v = value
    while isinstance(v, Node):
        v = written_in_place(v)
        if v is ph:
            return epilogue, links
        name = overload_name(v)
        if v.op == "call_function" and (_functional(v) or name == "clone") and isinstance(v.args[0], Node):
            links.append(v)
            v = v.args[0]
            continue
        return None
    return None


def _aliases(node: Node, skip: set[Node]) -> list[Node]:
    """``node`` and every node that views it or is it written in place, transitively (``skip`` excluded)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        for u in n.users:
            if u not in skip and u.args and u.args[0] is n \
                    and (is_view(u) or (is_mutating(u) and written_in_place(u) is n)):
                stack.append(u)
    return out


def _unprovable(graph, ph: Node, epilogue: Node | None, links: list[Node]) -> str | None:
    """Why merging every link's storage into the region input's is not provably exact (None: it is)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    chain = set(links) | ({epilogue} if epilogue is not None else set())
    out = graph.output_node()
    stock_strides = ph.meta["val"].stride()
    prev = ph
    storages: set[Node] = {ph}
    for link in reversed(links):  # in program order: the link nearest the input first
        val = link.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(ph.meta["val"].shape) \
                or val.stride() != stock_strides:
            return f"{link.name} ({overload_name(link)}) does not keep the region's shape and strides"
        if link.args[0] is not prev and written_in_place(link.args[0]) is not prev:
            return f"{link.name} updates a view of the region, not the whole region"
        aliases = _aliases(prev, chain)
        for u_src in aliases:  # who else reads or writes the storage this link overwrites
            for user in u_src.users:
                if user is out:
                    return f"an output views the region's storage that {link.name} overwrites"
                if user in chain or user in aliases:
                    continue
                if order[user] > order[link]:
                    return f"{user.name} ({overload_name(user) or user.op}) reads the old region after {link.name} writes it"
        for arg in _tensor_args(link):
            if storage_root(arg) in storages:
                return f"{link.name} reads the region's own storage through {arg.name} while writing it"
        storages.add(link)
        prev = link
    return None


def _tensor_args(link: Node) -> list[Node]:
    found = []
    for a in list(link.args[1:]) + list(link.kwargs.values()):
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(x, Node):
                found.append(x)
    return found


def _rewrite(gm: GraphModule, ctx: PassContext, name: str, ph: Node, epilogue: Node | None,
             links: list[Node]) -> None:
    graph = gm.graph
    verify = ctx.config.verify and all(overload_name(n) != "clone" for n in links)
    shadow: Node | None = ph
    last = None
    for link in reversed(links):
        first = link.prev
        with graph.inserting_before(link):
            if verify:  # the stock functional op, on the stock value so far (read before the write below)
                shadow = graph.call_function(link.target, (shadow, *link.args[1:]), dict(link.kwargs))
            name_ = overload_name(link)
            base = link.args[0]
            if name_ == "clone":
                new = base  # the clone is the region input itself: its writes land in the buffer
            elif name_ in _SCATTER_VIEW:
                src, *view_args = link.args[1:]
                if isinstance(src, Node) and src.target is aten.copy.default and len(src.users) == 1 \
                        and shape_of(src.args[0]) == shape_of(src):
                    # functionalized slice assignment: copy(slice, new) materialises new in the slice's
                    # shape and dtype; copy_ into the slice converts and broadcasts the same way, once
                    src = src.args[1]
                view = graph.call_function(_SCATTER_VIEW[name_], (base, *view_args))
                graph.call_function(aten.copy_.default, (view, src))
                new = base
            else:
                new = graph.call_function(_twin(link), tuple(link.args), dict(link.kwargs))
                new.meta["val"] = link.meta.get("val")
        n = first.next
        while n is not link:  # the writes belong to the wrapped call the functional op was part of
            n.meta.setdefault("nn_module_stack", link.meta.get("nn_module_stack", {}))
            n = n.next
        link.replace_all_uses_with(new)
        after = link.next
        graph.erase_node(link)
        last = new
    if epilogue is not None:  # the copy back is a copy of the region onto itself now
        epilogue.replace_all_uses_with(epilogue.args[1])
        graph.erase_node(epilogue)
    if verify and last is not None:
        with graph.inserting_before(after):
            graph.call_function(audit, (auditor_node(gm, ctx.config.auditor), name, "ring write", last, shadow))

