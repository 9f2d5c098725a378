"""Lowering: each wrapped partition runs through the exact-shape replay engine (eager when it declines)."""

from __future__ import annotations

from torch.fx import GraphModule, Node

from cadence_fx.graph_utils import view_root
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
        runner = ctx.make_runner(getattr(gm, node.target), name=f"{name}", aliased=aliased)
        if runner is None:
            continue
        setattr(gm, node.target, runner)
        ctx.runners[f"{node.target}:{name}"] = runner
        lowered += 1
    gm.recompile()
    ctx.record("lower_replay", lowered)
    return gm
