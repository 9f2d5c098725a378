"""Workspace demand sizing: a module buffer the step only touches through bounded slices shrinks to them.

The stock estimator allocates its solver workspace for 16 steps x 1000 frames; the step reads and
writes steps < 10 and frames < 452. Every access to a buffer is followed through its slice /
narrow / select chain to the box of the buffer it can reach; the buffer is replaced by a copy of
the union of those boxes. Indices inside the chains are rewritten to non-negative form first, so
every access addresses the same elements it did (same values; views of the smaller buffer differ
in strides only, and what leaves a workspace is copied, never reduced, by the stock code).
"""

from __future__ import annotations

from torch.fx import GraphModule

from cadence_fx.graph_utils import reach, register_tensor
from cadence_fx.passes import PassContext

def shrink_workspace(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace module buffers whose every access is bounded by a smaller box with that box."""
    graph = gm.graph
    buffers = dict(gm.named_buffers())
    shrunk = 0
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in buffers or node.target.startswith("_cf_"):
            continue
        tensor = buffers[node.target]
        shape = tuple(tensor.shape)
        if not shape:
            continue
        uses = [n for n in graph.nodes if n.op == "get_attr" and n.target == node.target]
        found = reach(uses, shape)
        if found is None:
            continue
        bounds, rewrites = found
        if all(b >= s for b, s in zip(bounds, shape)):
            continue
        for n, args in rewrites:
            n.args = args
        box = tuple(slice(0, max(b, 1)) for b in bounds)
        attr = register_tensor(gm, "_cf_workspace_", tensor[box].clone())
        stock = node.target
        for use in uses:
            use.target = attr
        # drop the stock workspace from the program so nothing here keeps it alive
        owner_path, _, leaf = stock.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        owner._buffers.pop(leaf, None)
        ctx.demand[stock] = (shape, tuple(max(b, 1) for b in bounds))
        shrunk += 1
    graph.lint()
    gm.recompile()
    ctx.record("shrink_workspace", shrunk)
    return gm
