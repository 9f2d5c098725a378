"""Partitioning at the wrapped-callable boundaries: each wrapped call becomes its own sub-GraphModule."""

from __future__ import annotations

import heapq

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.split_module import split_module

from cadence_fx.analysis.graph_io import fetch_attr, flat_outputs, register_tensor, set_flat_output
from cadence_fx.annotations import PARTITION, RETURNED_PREFIX, SEGMENT, WRAPPED
from cadence_fx.analysis.ops import is_guard, is_mutating
from cadence_fx.passes import PassContext

aten = torch.ops.aten
# Ops that read device data on the host (a synchronization), which a CUDA graph cannot hold. Inside a
# wrapped callable they run eagerly between two replayed segments of it. ``istft`` checks its window
# envelope (the NOLA condition) with a host read every call; the rest return host-decided shapes or values.
CAPTURE_BREAKERS = frozenset({
    aten.istft, aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose,
    aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
})


def invocation(node: Node, wrap: tuple[str, ...]) -> str | None:
    """The wrapped invocation a node belongs to: the outermost wrapped module call on its stack.

    torch.export keys repeated calls of one module apart (``...@1``), so each solver step of a
    wrapped estimator is its own invocation and its own partition. The root path ``""``
    (``Contract.WHOLE_STEP``) is on every node's stack: wrapping it makes the whole step one partition.
    """
    for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if path in wrap:
            return key
    return None


def partition(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Group each wrapped invocation into one contiguous partition (a keyed topological sort schedules the
    graph) and split."""
    wrap = tuple(ctx.contract.wrap)
    if not wrap:
        return gm
    graph = gm.graph
    compute = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    label = {n: None if breaks_capture(n) or is_guard(n) else invocation(n, wrap) for n in compute}
    if not any(label.values()):
        return gm
    label = _segments(compute, label, tuple(ctx.contract.split_at))
    first: dict[str, int] = {}
    for i, n in enumerate(compute):
        if label[n] is not None:
            first.setdefault(label[n], i)
    order_key = {n: (first[label[n]] if label[n] is not None else i) for i, n in enumerate(compute)}
    edges: dict[Node, set[Node]] = {n: set() for n in compute}
    for n in compute:
        edges[n].update(user for user in n.users if user in label)
    # An in-place write is a barrier: nothing moves across it, so no read of the storage it
    # writes can be scheduled on the wrong side of it.
    prev_effect, since = None, []
    for n in compute:
        if _is_effect(n):
            for m in since:
                edges[m].add(n)
            if prev_effect is not None:
                edges[prev_effect].add(n)
            prev_effect, since = n, []
        else:
            if prev_effect is not None:
                edges[prev_effect].add(n)
            since.append(n)
    position = {n: i for i, n in enumerate(compute)}
    schedule = _keyed_topological_order(compute, edges, lambda n: (order_key[n], position[n]))
    _reorder(graph, schedule)
    part_of: dict[Node, int] = {}
    current, last = -1, object()
    for n in schedule:
        if label[n] != last:
            current += 1
            last = label[n]
        part_of[n] = n.meta[PARTITION] = current  # split_module copies it onto the node it makes of n
    names = {part_of[n]: label[n] for n in schedule}  # (wrapped invocation, segment) or None
    guards = _lift_export_guards(gm)
    returned_attrs = _unhook_returned_attributes(gm)
    gm.recompile()  # split_module reads the module's code, not only its graph

    def callback(node: Node) -> int:
        return part_of.get(node, 0)

    split = split_module(gm, gm, callback, keep_original_order=True, keep_original_node_name=True)
    for n in schedule:
        del n.meta[PARTITION]
    wrapped = 0
    for node in split.graph.nodes:
        sub = getattr(split, node.target) if node.op == "call_module" else None
        if isinstance(sub, GraphModule) and (idx := _partition_index(sub)) is not None \
                and names.get(idx) is not None:
            node.meta[WRAPPED], node.meta[SEGMENT] = names[idx]
            wrapped += 1
    _rehook_returned_attributes(split, returned_attrs)
    split.meta = dict(getattr(gm, "meta", {}))
    # split_module builds a plain graph; keep the exported module's pytree calling convention
    # (a single output stays a tensor, not a 1-tuple)
    split.graph._codegen = gm.graph._codegen
    _restore_export_guards(split, guards)
    ctx.record("partition", wrapped)
    return split


def _segments(compute: list[Node], label: dict[Node, str | None],
              split_at: tuple[str, ...]) -> dict[Node, tuple[str, int] | None]:
    """Label each wrapped node with (invocation, segment): a new segment starts at every invocation of a
    ``split_at`` module inside the wrapped one, and the nodes after it (the loop's glue) stay with it."""
    segment: dict[str, int] = {}
    inner_of: dict[str, str] = {}
    out: dict[Node, tuple[str, int] | None] = {}
    for n in compute:
        outer = label[n]
        if outer is None:
            out[n] = None
            continue
        inner = invocation(n, split_at) if split_at else None
        if inner is not None and inner != inner_of.get(outer, inner):
            segment[outer] = segment.get(outer, 0) + 1
        if inner is not None:
            inner_of[outer] = inner
        out[n] = (outer, segment.get(outer, 0))
    return out


def breaks_capture(node: Node) -> bool:
    """True for a node a CUDA graph cannot hold: a host read of device data, or a copy between the
    host and the device (0-dim host tensors excepted: device ops read them as scalars)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and t.overloadpacket in CAPTURE_BREAKERS:
        return True
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor):
        return False
    inputs = [a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    devices = {v.device.type for v in inputs if not (v.dim() == 0 and v.device.type == "cpu")}
    return bool(devices) and len(devices | {val.device.type}) > 1


# the grad-mode and autocast switches split_module repeats in every partition a region of them spans
# (a copy of the node, so of its meta, where the region re-enters or exits): another partition's index
_REENTERED = frozenset({torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast})


def _partition_index(sub: GraphModule) -> int | None:
    """The partition ``split_module`` made ``sub`` of: the :data:`~cadence_fx.annotations.PARTITION` its
    nodes carry, taken off them (its inputs, whose meta is copied from the node that feeds them, and the
    repeated switches carry another partition's). None where it holds no other node: nothing to replay."""
    found: set[int] = set()
    for n in sub.graph.nodes:
        idx = n.meta.pop(PARTITION, None)
        if idx is not None and n.op not in ("placeholder", "get_attr") and n.target not in _REENTERED:
            found.add(idx)
    if len(found) > 1:
        raise RuntimeError(f"partition: split_module put nodes of partitions {sorted(found)} into one module")
    return found.pop() if found else None


def _lift_export_guards(gm: GraphModule) -> list[tuple[str, torch.nn.Module, tuple, dict]]:
    """Take the input guards (``analysis.ops.is_guard``: a Python call on the inputs, which inside a
    partition would make its written arguments unknown) out of the graph before splitting; they go
    back at the top after, outside every partition."""
    out = []
    for n in [n for n in gm.graph.nodes if is_guard(n)]:
        if n.users or not all(a.op == "placeholder" for a in n.all_input_nodes):
            continue  # not the plain input check export emits: leave it where it is
        out.append((str(n.target), gm.get_submodule(str(n.target)),
                    tuple(a.name if isinstance(a, Node) else a for a in n.args), dict(n.kwargs)))
        gm.graph.erase_node(n)
    return out


def _restore_export_guards(split: GraphModule, guards: list[tuple[str, torch.nn.Module, tuple, dict]]) -> None:
    phs = {n.name: n for n in split.graph.nodes if n.op == "placeholder"}
    first = next((n for n in split.graph.nodes if n.op != "placeholder"), None)
    for target, module, args, kwargs in guards:
        split.add_submodule(target, module)
        with split.graph.inserting_before(first):
            split.graph.call_module(target, tuple(phs.get(a, a) if isinstance(a, str) else a for a in args), kwargs)


def _is_effect(n: Node) -> bool:
    return is_mutating(n) or n.op == "call_module" or n.is_impure()


def _reorder(graph: Graph, schedule: list[Node]) -> None:
    out = graph.output_node()
    for n in schedule:
        out.prepend(n)


def _keyed_topological_order(nodes: list[Node], edges: dict[Node, set[Node]], key) -> list[Node]:
    """The topological order of ``nodes`` that takes, among the nodes ready at each step, the one of
    the smallest ``key`` (Kahn's algorithm over a heap): wrapped nodes move next to the first node of
    their invocation, everything else keeps its place."""
    indegree = {n: 0 for n in nodes}
    for n in nodes:
        for m in edges[n]:
            indegree[m] += 1
    ready = [(key(n), i, n) for i, n in enumerate(nodes) if indegree[n] == 0]
    heapq.heapify(ready)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for m in edges[n]:
            indegree[m] -= 1
            if indegree[m] == 0:
                heapq.heappush(ready, (key(m), index[m], m))
    if len(out) != len(nodes):
        raise RuntimeError("partition: the graph's dependencies have a cycle")  # an FX graph never has one
    return out


def _unhook_returned_attributes(gm: GraphModule) -> dict[int, torch.Tensor]:
    """Take out of the outputs every module tensor the step returns as it is (a hoisted constant, a
    weight): ``split_module`` with ``keep_original_order`` builds the root's ``get_attr`` nodes only
    for what a partition reads, and fails on one only the output reads. ``{output slot: tensor}``."""
    out: dict[int, torch.Tensor] = {}
    unhooked = []
    for i, v in enumerate(flat_outputs(gm.graph)):
        if isinstance(v, Node) and v.op == "get_attr":
            out[i] = fetch_attr(gm, v.target)
            set_flat_output(gm.graph, i, None)
            unhooked.append(v)
    for n in unhooked:
        if not n.users:  # read by nothing but the output: the split would keep it as a dangling node
            gm.graph.erase_node(n)
    return out


def _rehook_returned_attributes(split: GraphModule, returned: dict[int, torch.Tensor]) -> None:
    """Put the tensors :func:`_unhook_returned_attributes` took out back into the split root's outputs,
    each as an attribute of the root (the same tensor: no copy)."""
    if not returned:
        return
    out = split.graph.output_node()
    for i, t in returned.items():
        with split.graph.inserting_before(out):
            node = split.graph.get_attr(register_tensor(split, RETURNED_PREFIX, t))
        set_flat_output(split.graph, i, node)
