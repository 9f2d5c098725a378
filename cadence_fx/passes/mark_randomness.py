"""Randomness marking: which calls of the rewritten step draw from a generator.

Sessions keep one random stream each (:mod:`cadence_fx.runtime.rng`): the runtime installs a
session's generator states around every draw. This pass marks where draws happen: each partition
whose graph holds a random op, and each random op left in the root graph (no partitions).
"""

from __future__ import annotations

from torch.fx import GraphModule

from cadence_fx.annotations import RANDOM
from cadence_fx.graph_utils import is_random
from cadence_fx.passes import PassContext


def mark_randomness(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Set ``meta[RANDOM]`` on every root-level node that draws, directly or inside its partition."""
    marked = 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            draws = hasattr(sub, "graph") and any(is_random(n) for n in sub.graph.nodes)
        else:
            draws = is_random(node)
        if draws:
            node.meta[RANDOM] = True
            marked += 1
    ctx.record("mark_randomness", marked)
    return gm
