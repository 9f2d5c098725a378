"""The bytes one call writes to build a region's outgoing state, counted from the graph.

``carry_writeback`` counts them for the stock program before any state pass and
``retention_in_place`` for the rewritten one (``ProgramFacts.state_bytes``, reported by
:func:`cadence_fx.plan.state_traffic`): data movement into the state (a cat, a clone, a functional
``index_copy``, a copy into the region buffer), not the arithmetic that computes the new positions.

A node's value is the one export recorded (``meta["val"]``); the nodes the passes insert (views,
copies) carry none, and theirs is computed on the meta device from their inputs' values; an
in-place or ``out=`` op's value is the tensor it writes, so nothing is run that writes. A value
that cannot be had (no recorded value and an op the meta device cannot run, or not an ATen op) is
never counted as 0 bytes: :func:`state_bytes_written` raises :class:`UncountedBytes`, and the
caller records the count as unknown.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_aggregate

from cadence_fx.analysis.aliases import storage_root, written_in_place
from cadence_fx.analysis.graph_io import fetch_attr, numel
from cadence_fx.analysis.ops import MOVES, is_mutating, is_out_op, overload_name, written_args


class UncountedBytes(Exception):
    """A value on the way to a state whose size the graph does not give: the count would be a guess."""

    def __init__(self, node: Node, why: str) -> None:
        super().__init__(f"{node.format_node()}: {why}")
        self.node = node


def _as_meta(value: object) -> object:
    """A tensor value as a plain meta tensor of the same shape, strides and dtype (others as they are):
    recorded values are fake tensors of export's mode, and an op cannot mix those with meta tensors."""
    if isinstance(value, (list, tuple)):
        return type(value)(_as_meta(v) for v in value)
    if isinstance(value, torch.Tensor) and not (value.device.type == "meta" and type(value) is torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class _Values:
    """Each node's value (a tensor of the right shape, strides and dtype; never its elements), found once."""

    def __init__(self) -> None:
        self.cache: dict[Node, object] = {}

    def of(self, node: object) -> object:
        if not isinstance(node, Node):
            return node
        if node not in self.cache:
            self.cache[node] = self._compute(node)
        return self.cache[node]

    def tensor(self, node: object) -> torch.Tensor:
        """``node``'s value, which must be a tensor."""
        val = self.of(node)
        if not isinstance(val, torch.Tensor):
            raise UncountedBytes(node, f"its value is {type(val).__name__}, not a tensor")
        return val

    def _compute(self, node: Node) -> object:
        val = node.meta.get("val")
        if val is not None:
            return val
        if node.op == "get_attr":
            t = fetch_attr(node.graph.owning_module, str(node.target))
            if not isinstance(t, torch.Tensor):
                raise UncountedBytes(node, "it names no tensor of the module")
            return _as_meta(t)
        if node.op == "call_function" and node.target is operator.getitem:  # an item of a split's views
            items = self.of(node.args[0])
            if not isinstance(items, (list, tuple)):
                raise UncountedBytes(node, f"an item of {type(items).__name__}, not of a list of tensors")
            return items[node.args[1]]
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            raise UncountedBytes(node, "no recorded value, and not an ATen op")
        written = written_in_place(node)
        if written is not node:  # an in-place or ``out=`` op returns the tensor it wrote
            return self.of(written)
        args = map_aggregate(node.args, lambda a: _as_meta(self.of(a)))
        kwargs = map_aggregate(node.kwargs, lambda a: _as_meta(self.of(a)))
        try:
            with torch.no_grad():
                return node.target(*args, **kwargs)
        except Exception as e:  # the reason goes with the node; the count is unknown, not 0
            raise UncountedBytes(node, f"the meta device cannot run it ({type(e).__name__}: {e})") from e


def _bytes_written(node: Node, values: _Values) -> int:
    """Bytes an in-place ATen op writes (its first argument is the tensor written)."""
    name = overload_name(node).rstrip("_")
    args = node.args
    val = values.tensor(args[0])
    size = val.element_size()
    if name in ("index_copy", "index_fill"):  # (self, dim, index, src/value): every position the index names
        rest = list(val.shape)
        dim = args[1] % max(len(rest), 1)
        rest[dim] = values.tensor(args[2]).numel()
        return numel(rest) * size
    if name == "scatter":  # (self, dim, index, src/value): one element per index entry
        return values.tensor(args[2]).numel() * size
    if name == "index_put":  # (self, indices, values): the broadcast index shape times the dims not indexed
        idx = [values.tensor(i).shape for i in args[1] if i is not None]
        indexed = torch.broadcast_shapes(*idx) if idx else ()
        plain = [s for s, i in zip(val.shape, args[1]) if i is None] + list(val.shape[len(args[1]):])
        return numel(indexed) * numel(plain) * size
    return val.numel() * size  # copy_, fill_, zero_, ...: the whole (viewed) tensor


def _nbytes(val: torch.Tensor) -> int:
    return val.numel() * val.element_size()


def state_bytes_written(graph: Graph, value: object, aliases: dict[Node, object] | None = None) -> int:
    """Bytes one call writes to build ``value`` (a region's outgoing state) by moving data.

    Walks back from ``value`` through views, in-place writes into the storage it lives in, and data
    movement ops (:data:`~cadence_fx.analysis.ops.MOVES`: a cat, a clone, a functional index_copy ...),
    counting each op's written bytes once: an allocating op its whole output, an in-place op the
    elements it writes. Arithmetic (the projection of the new frames) is where the walk stops: it is
    compute, not state traffic. ``aliases`` maps nodes that share one storage at run time (a region
    input and its buffer's ``get_attr`` nodes) to one key. Identical for the stock and the rewritten
    graph, so the two numbers compare like for like. Raises :class:`UncountedBytes` where a value it
    needs cannot be had.
    """
    aliases = aliases or {}
    values = _Values()
    writers: dict[object, list[Node]] = {}
    for n in graph.nodes:
        if is_mutating(n):
            for w in written_args(n):
                if isinstance(w, Node):
                    root = storage_root(w)
                    writers.setdefault(aliases.get(root, root), []).append(n)
    total = 0
    counted: set[Node] = set()
    roots: set[object] = set()
    stack = [value]
    while stack:
        n = stack.pop()
        if not isinstance(n, Node):
            continue
        root = storage_root(n)
        key = aliases.get(root, root)
        if key not in roots:
            roots.add(key)
            for w in writers.get(key, ()):  # everything written into this storage
                if w not in counted:
                    counted.add(w)
                    if is_out_op(w):
                        if overload_name(w) in MOVES:  # a move straight into the state: its bytes, its sources
                            total += _nbytes(values.tensor(w.kwargs["out"]))
                            for a in w.args:
                                stack.extend(a if isinstance(a, (list, tuple)) else [a])
                        continue  # otherwise arithmetic computed straight into the state: compute, not traffic
                    total += _bytes_written(w, values)
                    stack.extend(a for a in w.args[1:] if isinstance(a, Node))
        if root is not None and root.op == "call_function" and overload_name(root) in MOVES and root not in counted:
            counted.add(root)
            total += _nbytes(values.tensor(root))
            for a in root.args:
                stack.extend(a if isinstance(a, (list, tuple)) else [a])
    return total
