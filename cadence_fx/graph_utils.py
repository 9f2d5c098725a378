"""Small helpers over ATen-level FX graphs shared by the passes."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

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


def is_mutating(node: Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def view_root(node: object) -> Node | None:
    """The non-view node that ``node`` is (transitively) a view of."""
    while isinstance(node, Node) and (is_view(node) or _is_view_tuple(node)):
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


def nodes_between(start: Node, end: Node) -> Iterable[Node]:
    n = start
    while n is not end:
        yield n
        n = n.next


def flat_view(graph: Graph, buf: Node, start: int, shape: Sequence[int]) -> Node:
    """``buf[start:start+numel(shape)].view(shape)``: a contiguous view into a flat buffer."""
    part = graph.call_function(aten.slice.Tensor, (buf, 0, start, start + numel(shape)))
    return graph.call_function(aten.view.default, (part, list(shape)))


def cat_dim(cat: Node) -> int:
    """The non-negative concatenation dim of an ``aten.cat`` node."""
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    rank = len(shape_of(cat) or ())
    return dim % rank if rank else dim
