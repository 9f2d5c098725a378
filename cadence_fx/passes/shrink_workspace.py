"""Workspace demand sizing: a module buffer the step only touches through bounded slices shrinks to them.

The stock estimator allocates its solver workspace for 16 steps x 1000 frames; the step reads and
writes steps < 10 and frames < 452. Every access to a buffer is followed through its slice /
narrow / select chain to the box of the buffer it can reach; the buffer is replaced by a copy of
the union of those boxes. Indices inside the chains are rewritten to non-negative form first, so
every access addresses the same elements it did (same values; views of the smaller buffer differ
in strides only, and what leaves a workspace is copied, never reduced, by the stock code).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from cadence_fx.annotations import WORKSPACE_PREFIX, WORKSPACE_STOCK_SIZE, is_owned_attr
from cadence_fx.analysis.boxes import access_boxes, leaf_consumers, reach, stride_independent
from cadence_fx.analysis.graph_io import register_tensor
from cadence_fx.analysis.ops import is_guard, overload_name
from cadence_fx.passes import PassContext
from cadence_fx.runtime.workspaces import SharedWorkspace


def shrink_workspace(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace module buffers whose every access is bounded by a smaller box with that box."""
    graph = gm.graph
    buffers = dict(gm.named_buffers())
    shrunk = 0
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target not in buffers or is_owned_attr(node.target):
            continue
        tensor = buffers[node.target]
        shape = tuple(tensor.shape)
        if not shape:
            continue
        uses = graph.find_nodes(op="get_attr", target=node.target)
        found = reach(uses, shape)
        if found is None:
            continue
        bounds, rewrites = found
        if all(b >= s for b, s in zip(bounds, shape)):
            continue
        reader = _layout_bound_reader(uses, shape)
        if reader is not None:  # the smaller copy's strides differ: only layout-independent reads are exact
            ctx.program.leave_stock(WORKSPACE_STOCK_SIZE, node.target,
                                    f"{reader} reads it by more than moving or mapping elements")
            continue
        for n, args in rewrites:
            n.args = args
        attr = _shared_copy(gm, ctx.tables.workspaces, tensor, bounds)
        stock = node.target
        for use in uses:
            use.target = attr
        # drop the stock workspace from the program so nothing here keeps it alive
        owner_path, _, leaf = stock.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        owner._buffers.pop(leaf, None)
        shrunk += 1
    graph.lint()
    ctx.record("shrink_workspace", shrunk)
    return gm


def _layout_bound_reader(uses: list, shape: tuple[int, ...]) -> str | None:
    """The first use of the workspace whose result may depend on its strides (None: there is none)."""
    for u in uses:
        for user, view, _box in access_boxes(u, shape) or [(u, u, None)]:
            if overload_name(user) == "copy_" and user.args[0] is view:
                continue  # written
            for c in leaf_consumers(user):
                if c.op != "output" and not is_guard(c) and not stride_independent(c, view):
                    return f"{c.name} ({overload_name(c) or c.op})"
    return None


def _shared_copy(gm: GraphModule, table: dict[tuple, SharedWorkspace], stock: torch.Tensor, bounds: list[int]) -> str:
    """Register on ``gm`` the one copy of ``stock`` that covers every program's box (grown as needed).

    Each catalog class reaches a different box (302, 352 or 402 frames of history); all of them
    address the same workspace, so one copy of the union box serves every class.
    """
    entry = table.get(_key(stock))
    if entry is None:
        entry = table[_key(stock)] = SharedWorkspace(stock=stock, bounds=[0] * len(bounds))
    union = [max(a, b, 1) for a, b in zip(entry.bounds, bounds)]
    if union != entry.bounds or entry.tensor is None:
        entry.bounds = union
        if entry.tensor is not None:
            entry.stale.append(entry.tensor)
        entry.tensor = stock[tuple(slice(0, b) for b in union)].clone()
    return register_tensor(gm, WORKSPACE_PREFIX, entry.tensor)


def _key(t: torch.Tensor) -> tuple:
    # the same workspace reaches each exported program as its own tensor object over one storage
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
