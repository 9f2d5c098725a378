"""The module tensors a program writes in place, and whether what one call writes reaches the next.

A model may keep state of its own in module buffers (a counter, a cache it updates in place) outside
the contract's regions. The runtime must give each lane and session its own copy of such a buffer
when a call can read what an earlier call left in it (carried state) and may share it when every
call overwrites it before reading (scratch); ``bind_constants`` must not fold a written buffer into
a constant. :func:`attribute_writes` tells them apart, walking the program in execution order.
"""

from __future__ import annotations

from torch.fx import Graph, GraphModule, Node

from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.ops import is_out_op, is_view, overload_name, returns_views, written_args

# In-place ops that write their whole destination without reading it: a buffer written only by these
# before any read in a call holds nothing from the previous call. The index-addressed writes
# (``index_copy_``, ``scatter_``, ``masked_fill_``, ``index_put_``) are not among them: they write the
# positions an index names, and the rest of the buffer still holds what earlier calls wrote there
# (a KV cache written at this call's positions and read whole).
_BLIND_WRITES = {"copy_", "fill_", "zero_"}


def attribute_writes(gm: GraphModule) -> dict[str, bool]:
    """Every ``get_attr`` target ``gm`` writes in place, mapped to whether a call can read what an
    earlier call left in it (``True``: carried state) or not (``False``: scratch).

    The program is walked in execution order, into the sub-GraphModules it calls (their inputs mapped
    to the outer tensors). A target is carried when it is read before the call first writes it, or
    written by an op that also reads its destination (``add_``, an accumulating ``index_put_``).
    What a blind write (``copy_``, ``fill_``, ``index_copy_`` ...) does not cover and no write ever
    touches stays what it was at load time, the same every call.
    """
    first: dict[str, str] = {}  # target -> "write" | "read" (its first access)
    carried: set[str] = set()
    written: set[str] = set()

    def target_of(arg: object, env: dict[Node, str], prefix: str) -> str | None:
        root = view_root(arg)
        if root is None:
            return None
        if root in env:
            return env[root]
        return prefix + str(root.target) if root.op == "get_attr" else None

    def walk(graph: Graph, env: dict[Node, str], module: GraphModule, prefix: str) -> None:
        for n in graph.nodes:
            if n.op == "call_module":
                sub = _sub_graph_module(getattr(module, n.target, None))
                if sub is not None:
                    placeholders = sub.graph.find_nodes(op="placeholder")
                    inner = {ph: t for ph, a in zip(placeholders, n.args)
                             if (t := target_of(a, env, prefix)) is not None}
                    # a partition's own attributes are named from gm, through the partition
                    walk(sub.graph, inner, sub, f"{prefix}{n.target}.")
                continue
            if n.op not in ("call_function", "output") or (
                    n.op == "call_function" and (is_view(n) or returns_views(n))):
                continue  # a view reads nothing: its users do, through view_root
            dests = written_args(n) if n.op == "call_function" else []
            for a in n.all_input_nodes:  # every node argument, nested in lists or not
                t = target_of(a, env, prefix)
                if t is None:
                    continue
                if any(a is d for d in dests):
                    written.add(t)
                    # an ``out=`` op computes into its destination without reading it, as a copy does
                    reads_dest = (overload_name(n) not in _BLIND_WRITES and not is_out_op(n)) or (
                        overload_name(n) == "scatter_" and "reduce" in n.kwargs)
                    if reads_dest and t not in first:
                        carried.add(t)
                    first.setdefault(t, "write")
                else:
                    if first.setdefault(t, "read") == "read":
                        carried.add(t)

    walk(gm.graph, {}, gm, "")
    return {t: t in carried for t in written}


def _sub_graph_module(module: object) -> GraphModule | None:
    """The GraphModule a ``call_module`` runs: the module itself, or the one a runtime runner wraps as ``fn``."""
    if isinstance(module, GraphModule):
        return module
    inner = getattr(module, "fn", None)
    return inner if isinstance(inner, GraphModule) else None
