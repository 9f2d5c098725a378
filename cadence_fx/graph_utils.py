"""Small helpers over ATen-level FX graphs shared by the passes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten


def overload_name(node: Node) -> str:
    """``'cat'`` for ``aten.cat.default``; empty for non-ATen targets."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return ""


def is_view(node: Node) -> bool:
    """True when the op returns an alias of its first argument without writing it."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return node.op == "call_function" and t.__name__ == "getitem" and _is_view_tuple(node.args[0])
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _is_view_tuple(node: object) -> bool:
    # split/chunk/unbind return lists of views of their input
    return isinstance(node, Node) and overload_name(node) in {"split", "split_with_sizes", "chunk", "unbind"}


def is_random(node: Node) -> bool:
    """True for an ATen op that draws from a generator (``torch.Tag.nondeterministic_seeded``)."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def is_mutating(node: Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def view_root(node: object) -> Node | None:
    """The non-view node that ``node`` is (transitively) a view of."""
    while isinstance(node, Node) and (is_view(node) or _is_view_tuple(node)):
        node = node.args[0]
    return node if isinstance(node, Node) else None


def written_in_place(node: object) -> Node | None:
    """The tensor an in-place op returns is its first argument, written: follow such returns
    (``cache.index_copy_(...)``, ``scatter_``, ``index_put_``) back to the tensor they wrote."""
    while isinstance(node, Node) and node.op == "call_function" and is_mutating(node) and node.args \
            and isinstance(node.args[0], Node):
        rets = node.target._schema.returns
        if not rets or rets[0].alias_info is None or not rets[0].alias_info.is_write:
            break
        node = node.args[0]
    return node if isinstance(node, Node) else None


def shape_of(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def output_node(graph: Graph) -> Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def flat_outputs(graph: Graph) -> list[object]:
    vals = output_node(graph).args[0]
    return list(vals) if isinstance(vals, (list, tuple)) else [vals]


def set_flat_output(graph: Graph, index: int, value: object) -> None:
    out = output_node(graph)
    vals = out.args[0]
    if isinstance(vals, (list, tuple)):
        new = list(vals)
        new[index] = value
        out.args = (type(vals)(new),)
    else:
        out.args = (value,)


def register_tensor(gm: GraphModule, prefix: str, tensor: torch.Tensor) -> str:
    """Attach ``tensor`` to ``gm`` under a fresh name (kept as-is: no copy, same strides)."""
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    name = f"{prefix}{i}"
    gm.register_buffer(name, tensor, persistent=False)
    return name


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)



def flat_view(graph: Graph, buf: Node, start: int, shape: Sequence[int]) -> Node:
    """``buf[start:start+numel(shape)].view(shape)``: a contiguous view into a flat buffer."""
    part = graph.call_function(aten.slice.Tensor, (buf, 0, start, start + numel(shape)))
    return graph.call_function(aten.view.default, (part, list(shape)))


def cat_dim(cat: Node) -> int:
    """The non-negative concatenation dim of an ``aten.cat`` node."""
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    rank = len(shape_of(cat) or ())
    return dim % rank if rank else dim


_SLICES = {"slice", "narrow", "select"}
_ESCAPING = {"as_strided", "as_strided_", "set_", "resize_", "view_as_real", "view_as_complex"}


@dataclass
class _View:
    dims: list[int]  # original dim of each current dim
    start: dict[int, int]  # offset into the original dim
    length: dict[int, int]


def reach(roots: Sequence[Node], shape: Sequence[int]) -> tuple[list[int], list[tuple[Node, tuple]]] | None:
    """The box of a tensor of ``shape`` that the uses of ``roots`` can touch, per dim (exclusive end).

    Every use is followed through slice / narrow / select chains; any other use reaches the box
    of the view it sees. Also returns the chain ops with their indices normalised to non-negative
    form (so they address the same elements if the tensor is replaced by a smaller box). None
    when a use can escape the box (``as_strided`` and friends) or an index is not a constant.
    """
    bounds = [0] * len(shape)
    rewrites: list[tuple[Node, tuple]] = []
    for root in roots:
        view = _View(list(range(len(shape))), {d: 0 for d in range(len(shape))}, dict(enumerate(shape)))
        if not _walk(root, view, bounds, rewrites):
            return None
    return bounds, rewrites


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

