"""Constant binding: the weights and constants a partition only reads become its own attributes.

``split_module`` (with the original order kept) leaves every ``get_attr`` in the outer graph and
passes the tensor to each partition as an input. A partition replayed as a CUDA graph then pays, on
every call, one attribute lookup in the outer graph and one signature check in the replay engine per
weight: for the released Moshi LM hundreds of weights next to its 100 state inputs, more host time
than the state itself. A weight does not change between calls, so the partition reads it as its own
attribute instead: the same tensor object, registered on the sub-module under the outer name
(``annotations.bound_name``; no copy), and the input goes away.

Only tensors no node of the program writes in place are bound (a workspace, a region buffer or a
counter stays an input, so the replay engine still sees, snapshots and restores what it writes).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from cadence_fx.annotations import bound_name
from cadence_fx.analysis.graph_io import fetch_attr
from cadence_fx.analysis.writes import attribute_writes
from cadence_fx.passes import PassContext


def bind_constants(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Move every read-only ``get_attr`` input of a partition into the partition."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(getattr(gm, n.target, None), GraphModule)]
    if not calls:
        return gm
    written = attribute_writes(gm)  # also what a partition writes through the input it is passed as
    bound = 0
    for call in calls:
        sub: GraphModule = getattr(gm, call.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if call.kwargs or len(placeholders) != len(call.args):
            continue  # not split_module's calling convention: leave it
        keep_args = []
        for ph, arg in zip(placeholders, call.args):
            value = fetch_attr(gm, arg.target) if isinstance(arg, Node) and arg.op == "get_attr" else None
            if not isinstance(value, torch.Tensor) or arg.target in written:
                keep_args.append(arg)
                continue
            name = bound_name(arg.target)
            if not hasattr(sub, name):
                if isinstance(value, torch.nn.Parameter):
                    sub.register_parameter(name, value)
                else:
                    sub.register_buffer(name, value, persistent=False)
            with sub.graph.inserting_before(ph):
                ref = sub.graph.get_attr(name)
            ref.meta = dict(ph.meta)
            ph.replace_all_uses_with(ref)
            sub.graph.erase_node(ph)
            bound += 1
        if len(keep_args) != len(call.args):
            call.args = tuple(keep_args)
            sub.graph.lint()
            sub.recompile()
    for n in gm.graph.find_nodes(op="get_attr"):
        if not n.users:
            gm.graph.erase_node(n)
    ctx.record("bind_constants", bound)
    return gm

