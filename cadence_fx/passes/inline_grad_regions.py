"""Inline ``wrap_with_set_grad_enabled`` regions: grad mode changes no value of an inference step.

torch.export wraps a ``with torch.no_grad():`` block inside the model (HiFT's sine generator)
in a higher-order op with its own subgraph. The optimized program runs without autograd, so the
region is just code; inlining it lets the other passes see inside (a host constant copied to the
device in there is hoisted like any other).
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch.fx import GraphModule, Node

from cadence_fx.annotations import INLINED_PREFIX
from cadence_fx.analysis.graph_io import register_tensor
from cadence_fx.passes import PassContext


def inline_grad_regions(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Splice every ``wrap_with_set_grad_enabled`` subgraph into the parent graph."""
    inlined = 0
    for node in hop_calls(gm, "wrap_with_set_grad_enabled"):
        splice_subgraph(gm, node, getattr(gm, node.args[1].target), node.args[2:])
        inlined += 1
    gm.graph.eliminate_dead_code()
    ctx.record("inline_grad_regions", inlined)
    return gm


def hop_calls(gm: GraphModule, name: str) -> list[Node]:
    """The calls of the higher-order op ``torch.ops.higher_order.<name>`` in ``gm``'s graph (none when
    this torch has no such op)."""
    hop = getattr(torch.ops.higher_order, name, None)
    return [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]


def splice_subgraph(gm: GraphModule, node: Node, sub: GraphModule, operands: Sequence[object]) -> None:
    """Copy ``sub``'s graph into ``gm``'s in place of the call ``node`` (``operands`` feed ``sub``'s
    placeholders in order), re-point the users of ``node`` (its ``getitem`` s) at the copied outputs,
    then erase ``node``. Tensors ``sub`` reads through ``get_attr`` are registered on ``gm``."""
    graph = gm.graph
    val_map: dict[Node, object] = {}
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(phs, operands):
        val_map[ph] = arg
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "get_attr":
                attr = register_tensor(gm, INLINED_PREFIX, getattr(sub, inner.target))
                val_map[inner] = graph.get_attr(attr)
        result = graph.graph_copy(sub.graph, val_map)
    outs = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        else:
            user.replace_input_with(node, outs[0] if len(outs) == 1 else node)
    if node.users:
        raise ValueError(f"splice_subgraph: {node.name} is used other than through getitem")
    graph.erase_node(node)
