"""Workspace demand sizing: a module buffer the step only touches through bounded slices shrinks to them.

The stock estimator allocates its solver workspace for 16 steps x 1000 frames; the step reads and
writes steps < 10 and frames < 452. Every access to a buffer is followed through its slice /
narrow / select chain to the box of the buffer it can reach; the buffer is replaced by a copy of
the union of those boxes. Indices inside the chains are rewritten to non-negative form first, so
every access addresses the same elements it did (same values; views of the smaller buffer differ
in strides only, and what leaves a workspace is copied, never reduced, by the stock code).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import GraphModule, Node

from cadence_fx.graph_utils import overload_name, register_tensor
from cadence_fx.passes import PassContext

_SLICES = {"slice", "narrow", "select"}
_ESCAPING = {"as_strided", "as_strided_", "set_", "resize_", "view_as_real", "view_as_complex"}


@dataclass
class _View:
    dims: list[int]  # original dim of each current dim
    start: dict[int, int]  # offset into the original dim
    length: dict[int, int]


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
        bounds = [0] * len(shape)
        rewrites: list[tuple[Node, tuple]] = []
        ok = True
        for use in uses:
            view = _View(list(range(len(shape))), {d: 0 for d in range(len(shape))}, dict(enumerate(shape)))
            if not _walk(use, view, bounds, rewrites):
                ok = False
                break
        if not ok or all(b >= s for b, s in zip(bounds, shape)):
            continue
        for n, args in rewrites:
            n.args = args
        box = tuple(slice(0, max(b, 1)) for b in bounds)
        attr = register_tensor(gm, "_cf_workspace_", tensor[box].clone())
        for use in uses:
            use.target = attr
        ctx.demand[node.target] = (shape, tuple(max(b, 1) for b in bounds))
        shrunk += 1
    graph.lint()
    gm.recompile()
    ctx.record("shrink_workspace", shrunk)
    return gm


def _walk(node: Node, view: _View, bounds: list[int], rewrites: list) -> bool:
    """Follow every use of ``node``; widen ``bounds`` to what each can reach. False: cannot bound."""
    for user in node.users:
        name = overload_name(user)
        if name in _ESCAPING:
            return False
        if name in _SLICES and user.args[0] is node and not user.kwargs:
            new, args = _narrow(user, view)
            if new is None:
                return False
            rewrites.append((user, args))
            if not _walk(user, new, bounds, rewrites):
                return False
            continue
        # any other use reaches (at most) the current view's box
        for od in range(len(bounds)):
            bounds[od] = max(bounds[od], view.start[od] + view.length[od])
    return True


def _narrow(user: Node, view: _View) -> tuple[_View | None, tuple]:
    name = overload_name(user)
    rank = len(view.dims)
    dim = (user.args[1] if len(user.args) > 1 else 0)
    if not isinstance(dim, int):
        return None, ()
    dim %= rank
    od = view.dims[dim]
    n = view.length[od]
    new = _View(list(view.dims), dict(view.start), dict(view.length))
    if name == "select":
        i = user.args[2]
        if not isinstance(i, int):
            return None, ()
        i = i + n if i < 0 else i
        new.start[od] += i
        new.length[od] = 1
        new.dims.pop(dim)
        return new, (user.args[0], dim, i)
    if name == "narrow":
        s, length = user.args[2], user.args[3]
        if not isinstance(s, int) or not isinstance(length, int):
            return None, ()
        s = s + n if s < 0 else s
        e = s + length
        args = (user.args[0], dim, s, length)
    else:
        s = user.args[2] if len(user.args) > 2 else 0
        e = user.args[3] if len(user.args) > 3 else n
        step = user.args[4] if len(user.args) > 4 else 1
        if step != 1 or not isinstance(s, (int, type(None))) or not isinstance(e, (int, type(None))):
            return None, ()
        s = 0 if s is None else (max(s + n, 0) if s < 0 else min(s, n))
        e = n if e is None else (max(e + n, 0) if e < 0 else min(e, n))
        e = max(e, s)
        args = (user.args[0], dim, s, e)
    new.start[od] += s
    new.length[od] = e - s
    return new, args

