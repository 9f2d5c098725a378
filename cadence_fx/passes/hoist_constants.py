"""Constant hoisting: host-built constants become device-resident buffers, computed once."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from cadence_fx.graph_utils import is_mutating, overload_name, register_tensor, view_root
from cadence_fx.passes import PassContext

# Factory ops whose result is fully determined by their arguments. ``empty*`` is left out:
# its contents are whatever the allocator hands back, so computing it "once" is not exact.
_FACTORIES = {"arange", "zeros", "ones", "full", "scalar_tensor", "linspace", "logspace", "eye",
              "zeros_like", "ones_like", "full_like", "lift_fresh_copy", "tensor"}
# A copy that changes device or dtype: the per-call host-to-device transfer we are removing.
_COPIES = {"_to_copy", "to", "_assert_tensor_metadata"}


def hoist_constants(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace each host-built constant cone (factory ops, dtype/device copies) by one precomputed buffer."""
    if not ctx.contract.hoist_constants:
        return gm
    graph = gm.graph
    mutated = {view_root(n.args[0]) for n in graph.nodes if is_mutating(n) and n.args and isinstance(n.args[0], Node)}
    const: set[Node] = set()
    host_built: set[Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            if n not in mutated:
                const.add(n)
            continue
        if n.op != "call_function" or is_mutating(n) or _is_random(n):
            continue
        inputs = n.all_input_nodes
        name = overload_name(n)
        if all(i in const for i in inputs) and (inputs or name in _FACTORIES) and name not in ("empty", "empty_like", "empty_strided"):
            const.add(n)
            if name in _FACTORIES or name in _COPIES or any(i in host_built for i in inputs):
                host_built.add(n)
    boundary = [n for n in graph.nodes if n in host_built and n.op == "call_function"
                and any(u not in const for u in n.users) and isinstance(n.meta.get("val"), torch.Tensor)]
    env: dict[Node, object] = {}

    def evaluate(node: Node) -> object:
        if node in env:
            return env[node]
        if node.op == "get_attr":
            val = gm
            for part in node.target.split("."):
                val = getattr(val, part)
        else:
            args = map_arg(node.args, evaluate)
            kwargs = map_arg(node.kwargs, evaluate)
            val = node.target(*args, **kwargs)
        env[node] = val
        return val

    # metadata assertions on constants are settled once here, not re-checked every call
    for n in list(graph.nodes):
        if overload_name(n) == "_assert_tensor_metadata" and n.args and n.args[0] in const:
            graph.erase_node(n)
    for n in boundary:
        value = evaluate(n)
        attr = register_tensor(gm, "_cf_const_", value)
        with graph.inserting_before(n):
            ref = graph.get_attr(attr)
        ref.meta = dict(n.meta)
        n.replace_all_uses_with(ref)
    graph.eliminate_dead_code()
    ctx.record("hoist_constants", len(boundary))
    return gm


def _is_random(node: Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags
