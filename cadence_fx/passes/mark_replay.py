"""Replay marking: each wrapped partition's call carries a ReplaySpec the runtime replays it by.

The pass only analyses and annotates (:mod:`cadence_fx.annotations`); the runtime installs the
replay engines (:mod:`cadence_fx.runtime.runners`).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from cadence_fx.annotations import REPLAY, SEGMENT, WRAPPED, ReplaySpec, is_state_attr
from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.graph_io import flat_outputs
from cadence_fx.analysis.ops import is_mutating
from cadence_fx.passes import PassContext


def mark_replay(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Annotate every wrapped partition with the arguments it aliases, reads only, and writes."""
    owned = {s.placeholder.name for s in ctx.program.regions.values()}
    marked = 0
    for node in gm.graph.nodes:
        name = node.meta.get(WRAPPED)
        if node.op != "call_module" or name is None:
            continue
        # Parameters, buffers, hoisted constants and region buffers live at fixed addresses for the
        # program's lifetime: the graph uses them in place (checked by pointer), never staged. Views
        # of them made in another partition (a solver step's cache slice cut by the eager loop) too.
        roots = {i: _fixed_root(gm, a) for i, a in enumerate(node.args) if isinstance(a, Node)}
        aliased = [i for i, root in roots.items()
                   if root is not None and (root.op == "get_attr" or root.name in owned)]
        written = written_arguments(getattr(gm, node.target))
        readonly = [i for i in aliased if written is not None and i not in written and _is_constant(roots[i])]
        seg = node.meta.get(SEGMENT, 0)
        node.meta[REPLAY] = ReplaySpec(name=f"{name}#{seg}" if seg else name, aliased=tuple(aliased),
                                       readonly=tuple(readonly),
                                       written=None if written is None else tuple(sorted(written)))
        marked += 1
    ctx.record("mark_replay", marked)
    return gm


def written_arguments(sub: GraphModule) -> set[int] | None:
    """Positions of the partition's arguments its graph writes (through any view), or None if unknown.

    A partition is a flat ATen graph: every write is an op whose schema marks an argument mutable.
    Anything the schema cannot vouch for (a module call, a Python callable) makes it unknown, and
    the replay engine then snapshots every argument it is not told is read-only.
    """
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    written = set()
    for n in sub.graph.nodes:
        if n.op == "call_module" or (n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload)
                                     and n.target is not operator.getitem):
            return None
        if n.op != "call_function" or not is_mutating(n):
            continue
        schema = n.target._schema
        for arg, formal in zip(n.args, schema.arguments):
            if formal.alias_info is not None and formal.alias_info.is_write and isinstance(arg, Node):
                written.add(view_root(arg))
        for key, arg in n.kwargs.items():
            formal = next((a for a in schema.arguments if a.name == key), None)
            if formal is not None and formal.alias_info is not None and formal.alias_info.is_write \
                    and isinstance(arg, Node):
                written.add(view_root(arg))
    return {i for i, ph in enumerate(phs) if ph in written}


def _fixed_root(gm: GraphModule, arg: Node) -> Node | None:
    """The node ``arg`` is a view of, followed through views and through partitions' outputs.

    An output of a partition that is a view of one of that partition's arguments continues at the
    argument passed in; anything else (a fresh tensor a partition computed) ends the walk.
    """
    root = view_root(arg)
    while root is not None and root.op == "call_function" and root.target is operator.getitem \
            and isinstance(root.args[0], Node) and root.args[0].op == "call_module":
        call, index = root.args[0], root.args[1]
        sub = getattr(gm, call.target)
        graph = sub.graph
        outs = flat_outputs(graph)
        inner = view_root(outs[index]) if isinstance(index, int) and index < len(outs) else None
        if inner is None or inner.op != "placeholder":
            return inner if inner is not None and inner.op == "get_attr" else root
        position = [n for n in graph.nodes if n.op == "placeholder"].index(inner)
        outer = call.args[position] if position < len(call.args) else None
        if not isinstance(outer, Node):
            return root
        root = view_root(outer)
    return root


def _is_constant(root: Node) -> bool:
    """Parameters, buffers and hoisted constants; not region buffers or workspaces (state)."""
    return root.op == "get_attr" and not is_state_attr(root.target)
