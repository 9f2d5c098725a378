"""A graph's outputs and its module's attributes, and the few nodes the passes build and read.

The state passes return a region's new state through one slot of the graph's flat output tuple
and keep buffers as module attributes reached by ``get_attr``; these helpers read and replace an
output slot, look up or attach an attribute, and build or read the nodes every such rewrite needs:
a contiguous view into a flat buffer, the dim of a ``cat``, the shape export recorded for a value.
The output node is torch's own :meth:`torch.fx.Graph.output_node` (the graph's last node).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.fx import Graph, GraphModule, Node

from cadence_fx.analysis.ops import aten


def flat_outputs(graph: Graph) -> list[object]:
    """The values the graph returns, as a list (one value returned alone is a list of one)."""
    vals = graph.output_node().args[0]
    return list(vals) if isinstance(vals, (list, tuple)) else [vals]


def set_flat_output(graph: Graph, index: int, value: object) -> None:
    """Return ``value`` in slot ``index`` of the graph's outputs (the only one, if it returns one value)."""
    out = graph.output_node()
    vals = out.args[0]
    if isinstance(vals, (list, tuple)):
        new = list(vals)
        new[index] = value
        out.args = (type(vals)(new),)
    else:
        out.args = (value,)


def fetch_attr(module: torch.nn.Module, target: str) -> object:
    """What a ``get_attr`` target names on ``module`` (a dotted path); ``None`` where it names nothing."""
    value: object = module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def register_tensor(gm: GraphModule, prefix: str, tensor: torch.Tensor) -> str:
    """Attach ``tensor`` to ``gm`` under a fresh name (kept as-is: no copy, same strides)."""
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    name = f"{prefix}{i}"
    gm.register_buffer(name, tensor, persistent=False)
    return name


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``."""
    return math.prod(shape)


def flat_view(graph: Graph, buf: Node, start: int, shape: Sequence[int]) -> Node:
    """``buf[start:start+numel(shape)].view(shape)``: a contiguous view into a flat buffer."""
    part = graph.call_function(aten.slice.Tensor, (buf, 0, start, start + numel(shape)))
    return graph.call_function(aten.view.default, (part, list(shape)))


def shape_of(node: object) -> tuple[int, ...] | None:
    """The shape export recorded for ``node`` (``meta["val"]``); None for a node without a tensor value,
    or one whose size depends on data (an unbacked symbol from ``.item()``: no pass may guess it)."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape):
        return tuple(val.shape)
    return None


def cat_dim(cat: Node) -> int:
    """The non-negative concatenation dim of an ``aten.cat`` node."""
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    rank = len(shape_of(cat) or ())
    return dim % rank if rank else dim
