"""Lowering: each wrapped partition runs through the exact-shape replay engine (eager when it declines)."""

from __future__ import annotations

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
        runner = ctx.make_runner(sub, name=f"{name}", aliased=aliased, readonly=_readonly(sub, node, aliased))
        if runner is None:
            continue
        setattr(gm, node.target, runner)
        ctx.runners[f"{node.target}:{name}"] = runner
        lowered += 1
    ctx.record("lower_replay", lowered)
    return gm


def _readonly(sub: GraphModule, call: Node, aliased: list[int]) -> list[int]:
    """Aliased arguments the partition never writes: parameters and constants, not state or workspaces."""
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    written = {view_root(n.args[0]) for n in sub.graph.nodes if is_mutating(n) and n.args and isinstance(n.args[0], Node)}
    out = []
    for i in aliased:
        arg = call.args[i]
        root = view_root(arg)
        if root is not None and root.op == "get_attr" and not str(root.target).startswith(("_cf_region_", "_cf_workspace_")) \
                and i < len(phs) and phs[i] not in written:
            out.append(i)
    return out
