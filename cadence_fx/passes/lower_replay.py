"""Lowering: each wrapped partition runs through the exact-shape replay engine (eager when it declines)."""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from cadence_fx.graph_utils import is_mutating, view_root
from cadence_fx.passes import PassContext


def lower_replay(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Swap every wrapped partition for a replay runner; fixed-address arguments are passed as aliased."""
    if ctx.make_runner is None:
        return gm
    owned = {s.placeholder.name for s in ctx.regions.values()}
    lowered = 0
    for node in gm.graph.nodes:
        name = node.meta.get("cadence_wrapped")
        if node.op != "call_module" or name is None:
            continue
        # Parameters, buffers, hoisted constants and region buffers live at fixed addresses for the
        # program's lifetime: the graph uses them in place (checked by pointer), never staged.
        aliased = [i for i, a in enumerate(node.args)
                   if isinstance(a, Node) and (root := view_root(a)) is not None
                   and (root.op == "get_attr" or root.name in owned)]
        sub = getattr(gm, node.target)
        written = _written(sub)
        readonly = [i for i in aliased if written is not None and i not in written and _is_constant(node.args[i])]
        runner = ctx.make_runner(sub, name=f"{name}", aliased=aliased, readonly=readonly,
                                 mutable=None if written is None else sorted(written))
        if runner is None:
            continue
        setattr(gm, node.target, runner)
        ctx.runners[f"{node.target}:{name}"] = runner
        lowered += 1
    ctx.record("lower_replay", lowered)
    return gm


def _written(sub: GraphModule) -> set[int] | None:
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


def _is_constant(arg: Node) -> bool:
    """Parameters, buffers and hoisted constants; not region buffers or workspaces (state)."""
    root = view_root(arg)
    return root is not None and root.op == "get_attr" and not str(root.target).startswith(("_cf_region_", "_cf_workspace_"))
