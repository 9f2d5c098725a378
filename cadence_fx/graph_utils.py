"""Small helpers over ATen-level FX graphs shared by the passes."""

from __future__ import annotations

import math
import operator
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


# seeded ops that return their input unchanged, drawing nothing, when ``p == 0`` or ``train`` is False
# (ATen's ``_dropout_impl``; the fused CUDA dropout is taken only for 0 < p < 1 in training)
_DROPOUTS = frozenset({"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})


def _literal(node: Node, index: int, name: str, default: object = None) -> object:
    """An argument of ``node`` given positionally or by name; a Node (a value known only at run time) as is."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _zero(p: object) -> bool:
    """A literal probability of exactly 0 (a Node, known only at run time, is not)."""
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def draws(node: Node) -> bool:
    """:func:`is_random` less the seeded ops whose literal arguments make them draw nothing.

    A dropout with ``p == 0`` or ``train=False`` returns its input; ``scaled_dot_product_attention``
    with ``dropout_p == 0`` asks no generator for an offset in any of its kernels (math, flash,
    memory-efficient, cuDNN). Models in eval mode keep both in their exported graphs, and treating them
    as draws would order every replay that holds one after every other lane's (the session streams of
    :mod:`cadence_fx.runtime.rng`) and make each a fence for parallel branches.
    """
    if not is_random(node):
        return False
    name = overload_name(node)
    if name in _DROPOUTS:
        return not (_zero(_literal(node, 1, "p")) or _literal(node, 2, "train") is False)
    if name == "scaled_dot_product_attention":
        return not _zero(_literal(node, 4, "dropout_p", 0.0))
    return True


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
    while isinstance(node, Node) and node.op == "call_function" and is_mutating(node):
        rets = node.target._schema.returns
        if not rets or rets[0].alias_info is None or not rets[0].alias_info.is_write:
            break
        if is_out_op(node):  # ``op.out(..., out=t)`` returns ``t``
            node = node.kwargs["out"]
        elif node.args and isinstance(node.args[0], Node):
            node = node.args[0]
        else:
            break
    return node if isinstance(node, Node) else None


def is_out_op(node: Node) -> bool:
    """An ``out=`` overload called with its ``out`` tensor (computes into it; reads nothing of it)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or "out" not in node.kwargs:
        return False
    args = t._schema.arguments
    return bool(args) and args[-1].name == "out" and args[-1].kwarg_only


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
        found = access_boxes(root, shape, rewrites)
        if found is None:
            return None
        for _user, _view, box in found:
            for d, (_s, e) in enumerate(box):
                bounds[d] = max(bounds[d], e)
    return bounds, rewrites


def access_boxes(root: Node, shape: Sequence[int], rewrites: list[tuple[Node, tuple]] | None = None,
                 ) -> list[tuple[Node, Node, list[tuple[int, int]]]] | None:
    """Every use of tensor ``root`` (of ``shape``) past its slice / narrow / select chains, with the box
    it can touch: ``[(user, the view it uses, [(start, end) per dim of root])]``. None when a use can
    escape (``as_strided`` and friends) or an index is not a constant. ``rewrites`` collects each chain
    op with its indices in non-negative form."""
    out: list[tuple[Node, Node, list[tuple[int, int]]]] = []

    def walk(node: Node, view: _View) -> bool:
        for user in node.users:
            name = overload_name(user)
            if name in _ESCAPING:
                return False
            if name in _SLICES and user.args[0] is node and not user.kwargs:
                new, args = _narrow(user, view)
                if new is None:
                    return False
                if rewrites is not None:
                    rewrites.append((user, args))
                if not walk(user, new):
                    return False
                continue
            out.append((user, node, [(view.start[d], view.start[d] + view.length[d]) for d in range(len(shape))]))
        return True

    ok = walk(root, _View(list(range(len(shape))), {d: 0 for d in range(len(shape))}, dict(enumerate(shape))))
    return out if ok else None


def is_guard(node: Node) -> bool:
    """The unlifted module's input-shape guard: it reads shapes, never elements."""
    return node.op == "call_module" and str(node.target).startswith("_guards")


def is_view_op(node: Node) -> bool:
    return is_view(node) or node.target is operator.getitem


def leaf_consumers(user: Node) -> list[Node]:
    """What reads the elements a use reaches: the use itself, or (a view) what reads that view."""
    return element_readers(user) if is_view_op(user) else [user]


def element_readers(node: Node) -> list[Node]:
    """The nodes that read ``node``'s elements: its users, through views (and split items)."""
    out, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if is_view_op(u) and u.args and u.args[0] is n:
                stack.append(u)
            else:
                out.append(u)
    return out


def stride_independent(consumer: Node, view: Node) -> bool:
    """Whether what ``consumer`` computes from ``view`` has the same bits whatever ``view``'s strides:
    it only moves elements (cat, copy, clone) or maps them one by one (a pointwise op). A reduction or
    a matmul may order its sums by the layout, so it is not."""
    name = overload_name(consumer)
    t = consumer.target
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags and not is_mutating(consumer):
        return True
    if name == "copy_":  # reading it as the source; a destination is a write, not a read
        return consumer.args[0] is not view and view_root(consumer.args[0]) is not view_root(view)
    if name == "_to_copy":
        val = consumer.meta.get("val")
        return isinstance(val, torch.Tensor) and val.dtype == view.meta.get("val", val).dtype
    return name in _MOVES


def box_covered(box: Sequence[tuple[int, int]], cover: Sequence[Sequence[tuple[int, int]]],
                _budget: list[int] | None = None) -> bool:
    """Whether the union of the boxes ``cover`` contains ``box`` (boxes as [(start, end) per dim]).

    Splits ``box`` around each overlapping cover box in turn; a pattern that needs more than a few
    thousand pieces answers False (the caller then leaves the program stock)."""
    budget = [4096] if _budget is None else _budget
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if any(e <= s for s, e in box):
        return True
    for i, c in enumerate(cover):
        inter = [(max(s, cs), min(e, ce)) for (s, e), (cs, ce) in zip(box, c)]
        if any(e <= s for s, e in inter):
            continue
        rest = list(cover[:i]) + list(cover[i + 1:])
        # the parts of box outside c: per dim, below and above c's range (earlier dims clipped to c)
        pieces = []
        for d, ((s, e), (cs, ce)) in enumerate(zip(box, inter)):
            head = list(inter[:d]) + [(s, cs)] + list(box[d + 1:])
            tail = list(inter[:d]) + [(ce, e)] + list(box[d + 1:])
            pieces += [head, tail]
        return all(box_covered(p, rest, budget) for p in pieces)
    return False


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



# ------------------------------------------------------------------ state bytes written per call

#: ATen ops that only move data (no arithmetic): what building a region's outgoing state costs.
_MOVES = {"cat", "clone", "contiguous", "copy", "_to_copy", "index_copy", "scatter", "index_put", "index_fill",
          "slice_scatter", "select_scatter", "stack", "narrow_copy", "index_select", "constant_pad_nd"}


def storage_root(node: object) -> Node | None:
    """The node whose storage ``node`` lives in: through views and through in-place ops' returns."""
    while True:
        root = view_root(node)
        written = written_in_place(root)
        if written is root:
            return root
        node = written


def _meta_val(node: object, cache: dict[Node, object]) -> object:
    """``node``'s value as a meta tensor: its recorded ``val``, else computed on the meta device (the
    views and copies the passes insert carry no ``val``)."""
    if not isinstance(node, Node):
        return node
    if node in cache:
        return cache[node]
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        t = getattr(node.graph.owning_module, str(node.target), None)
        val = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") \
            if isinstance(t, torch.Tensor) else None
    elif val is None and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        args = torch.fx.node.map_aggregate(node.args, lambda a: _meta_val(a, cache))
        kwargs = torch.fx.node.map_aggregate(node.kwargs, lambda a: _meta_val(a, cache))
        try:
            with torch.no_grad():
                val = node.target(*args, **kwargs)
        except Exception:  # an op the meta device cannot run: its bytes are not counted
            val = None
    cache[node] = val
    return val


def _meta_shape(node: object, cache: dict) -> tuple[int, ...]:
    val = _meta_val(node, cache)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def bytes_written(node: Node, cache: dict) -> int:
    """Bytes an in-place ATen op writes (its first argument is the tensor written)."""
    name = overload_name(node).rstrip("_")
    args = node.args
    val = _meta_val(args[0], cache)
    if not isinstance(val, torch.Tensor):
        return 0
    size = val.element_size()
    if name in ("index_copy", "index_fill"):  # (self, dim, index, src/value): every position the index names
        rest = list(val.shape)
        dim = args[1] % max(len(rest), 1)
        rest[dim] = numel(_meta_shape(args[2], cache))
        return numel(rest) * size
    if name == "scatter":  # (self, dim, index, src/value): one element per index entry
        return numel(_meta_shape(args[2], cache)) * size
    if name == "index_put":  # (self, indices, values): the broadcast index shape times the dims not indexed
        idx = [torch.Size(_meta_shape(i, cache)) for i in args[1] if i is not None]
        indexed = torch.broadcast_shapes(*idx) if idx else ()
        plain = [s for s, i in zip(val.shape, args[1]) if i is None] + list(val.shape[len(args[1]):])
        return numel(indexed) * numel(plain) * size
    return val.numel() * size  # copy_, fill_, zero_, ...: the whole (viewed) tensor


def state_bytes_written(graph: Graph, value: object, aliases: dict[Node, object] | None = None) -> int:
    """Bytes one call writes to build ``value`` (a region's outgoing state) by moving data.

    Walks back from ``value`` through views, in-place writes into the storage it lives in, and data
    movement ops (``_MOVES``: a cat, a clone, a functional index_copy ...), counting each op's
    written bytes once: an allocating op its whole output, an in-place op the elements it writes.
    Arithmetic (the projection of the new frames) is where the walk stops: it is compute, not state
    traffic. ``aliases`` maps nodes that share one storage at run time (a region input and its
    buffer's ``get_attr`` nodes) to one key. Identical for the stock and the rewritten graph, so the
    two numbers compare like for like.
    """
    aliases = aliases or {}
    cache: dict[Node, object] = {}
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
                        if overload_name(w) in _MOVES:  # a move straight into the state: its bytes, its sources
                            val = _meta_val(w.kwargs["out"], cache)
                            total += val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
                            for a in w.args:
                                stack.extend(a if isinstance(a, (list, tuple)) else [a])
                        continue  # otherwise arithmetic computed straight into the state: compute, not traffic
                    total += bytes_written(w, cache)
                    stack.extend(a for a in w.args[1:] if isinstance(a, Node))
        if root is not None and root.op == "call_function" and overload_name(root) in _MOVES and root not in counted:
            counted.add(root)
            val = _meta_val(root, cache)
            total += val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
            for a in root.args:
                stack.extend(a if isinstance(a, (list, tuple)) else [a])
    return total


def fetch_attr(module: torch.nn.Module, target: str) -> object:
    """What a ``get_attr`` target names on ``module`` (a dotted path); ``None`` where it names nothing."""
    value: object = module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


# In-place ops that write their destination without reading it: a buffer written only by these before
# any read in a call holds nothing from the previous call.
_BLIND_WRITES = {"copy_", "fill_", "zero_", "index_copy_", "index_fill_", "masked_fill_", "scatter_"}


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
                    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
                    inner = {ph: t for ph, a in zip(placeholders, n.args) if (t := target_of(a, env, prefix)) is not None}
                    # a partition's own attributes are named from gm, through the partition
                    walk(sub.graph, inner, sub, f"{prefix}{n.target}.")
                continue
            if n.op not in ("call_function", "output") or (n.op == "call_function" and (is_view(n) or _is_view_tuple(n))):
                continue  # a view reads nothing: its users do, through view_root
            dests = written_args(n) if n.op == "call_function" else []
            for a in _flat_args(n):
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


def written_args(n: Node) -> list[object]:
    """The arguments an in-place or ``out=`` ATen op writes (its schema's write aliases)."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(t._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only or arg.name in n.kwargs:
                out.append(n.kwargs.get(arg.name))
            elif i < len(n.args):
                out.append(n.args[i])
    return out


def _flat_args(n: Node) -> list[object]:
    flat: list[object] = []
    for a in [*n.args, *n.kwargs.values()]:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def _sub_graph_module(module: object) -> GraphModule | None:
    if isinstance(module, GraphModule):
        return module
    inner = getattr(module, "fn", None)
    return inner if isinstance(inner, GraphModule) else None

