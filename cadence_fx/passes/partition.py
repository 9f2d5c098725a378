"""Partitioning at the wrapped-callable boundaries: each wrapped call becomes its own sub-GraphModule."""

from __future__ import annotations

import networkx as nx
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.split_module import split_module

from cadence_fx.graph_utils import is_mutating
from cadence_fx.passes import PassContext

WRAPPED_PREFIX = "wrapped_"


def invocation(node: Node, wrap: tuple[str, ...]) -> str | None:
    """The wrapped invocation a node belongs to: the outermost wrapped module call on its stack.

    torch.export keys repeated calls of one module apart (``...@1``), so each solver step of a
    wrapped estimator is its own invocation and its own partition.
    """
    for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if path in wrap:
            return key
    return None


def partition(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Group each wrapped invocation into one contiguous partition (networkx schedules the graph) and split."""
    wrap = tuple(ctx.contract.wrap)
    if not wrap:
        return gm
    graph = gm.graph
    compute = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    label = {n: invocation(n, wrap) for n in compute}
    if not any(label.values()):
        return gm
    first: dict[str, int] = {}
    for i, n in enumerate(compute):
        if label[n] is not None:
            first.setdefault(label[n], i)
    order_key = {n: (first[label[n]] if label[n] is not None else i) for i, n in enumerate(compute)}
    dag = nx.DiGraph()
    dag.add_nodes_from(compute)
    for n in compute:
        for user in n.users:
            if user in label:
                dag.add_edge(n, user)
    # An in-place write is a barrier: nothing moves across it, so no read of the storage it
    # writes can be scheduled on the wrong side of it.
    prev_effect, since = None, []
    for n in compute:
        if _is_effect(n):
            dag.add_edges_from((m, n) for m in since)
            if prev_effect is not None:
                dag.add_edge(prev_effect, n)
            prev_effect, since = n, []
        else:
            if prev_effect is not None:
                dag.add_edge(prev_effect, n)
            since.append(n)
    position = {n: i for i, n in enumerate(compute)}
    schedule = list(nx.lexicographical_topological_sort(dag, key=lambda n: (order_key[n], position[n])))
    _reorder(graph, schedule)
    part_of: dict[Node, int] = {}
    current, last = -1, object()
    for n in schedule:
        if label[n] != last:
            current += 1
            last = label[n]
        part_of[n] = current
    names = {part_of[n]: label[n] for n in schedule}
    gm.recompile()  # split_module reads the module's code, not only its graph

    def callback(node: Node) -> int:
        return part_of.get(node, 0)

    split = split_module(gm, gm, callback, keep_original_order=True, keep_original_node_name=True)
    wrapped = 0
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target.startswith("submod_"):
            idx = int(node.target.split("_")[1])
            if names.get(idx) is not None:
                node.meta["cadence_wrapped"] = names[idx]
                wrapped += 1
    split.meta = dict(getattr(gm, "meta", {}))
    ctx.record("partition", wrapped)
    return split


def _is_effect(n: Node) -> bool:
    return is_mutating(n) or n.op == "call_module" or n.is_impure()


def _reorder(graph: Graph, schedule: list[Node]) -> None:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in schedule:
        out.prepend(n)
