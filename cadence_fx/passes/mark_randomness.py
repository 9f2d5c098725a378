"""Randomness marking: which calls of the rewritten step draw from a generator.

Sessions keep one random stream each (:mod:`cadence_fx.runtime.rng`): the runtime installs a
session's generator states around every draw. This pass marks where draws happen: each partition
whose graph holds a random op, and each random op left in the root graph (no partitions). A seeded op
whose arguments make it draw nothing (an eval-mode dropout) is not a draw (:func:`~cadence_fx.analysis.ops.draws`).
"""

from __future__ import annotations

from torch.fx import GraphModule

from cadence_fx.annotations import RANDOM
from cadence_fx.analysis.ops import draws
from cadence_fx.passes import PassContext


def mark_randomness(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Set ``meta[RANDOM]`` on every root-level node that draws, directly or inside its partition."""
    marked = 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            drawing = hasattr(sub, "graph") and any(draws(n) for n in sub.graph.nodes)
        else:
            drawing = draws(node)
        if drawing:
            node.meta[RANDOM] = True
            marked += 1
    ctx.record("mark_randomness", marked)
    return gm
