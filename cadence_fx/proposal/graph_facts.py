"""What the exported graph says about a state tensor: the cats that take it, the writes into it.

The eager replay shows values, not intent: the concatenation order a pass must reproduce and the
positions an in-place write names are read here, off ``torch.export``'s graph, with the node names a
user can look up in ``print(ep.graph)``. The state is a placeholder (a user input, or a module buffer
lifted by export); a functional update of it (``index_copy``, ``slice_scatter`` after
``run_decompositions``) counts as a write of it, as the in-place form does. A state may reach its cat
through other ops (a pad to a fixed size, a copy, a cut, a cat of it alone once transformers'
``torch.tensor([])`` operand is skipped): the chain is followed, and the cat the state's output is cut
from speaks for it first.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from torch.export import ExportedProgram
from torch.fx import Node

from cadence_fx.analysis.aliases import storage_root, view_root
from cadence_fx.analysis.graph_io import cat_dim, shape_of
from cadence_fx.analysis.ops import is_view, overload_name
from cadence_fx.analysis.writes import attribute_writes

# functional updates: a new tensor that is the state with some positions replaced
_UPDATES = {"index_copy", "scatter", "index_put", "index_fill", "slice_scatter", "select_scatter"}
_WRITES = _UPDATES | {u + "_" for u in _UPDATES if not u.endswith("_scatter")} | {"copy_"}
# views that restrict one dim of their input, given as their second argument
_RESTRICTING = {"slice", "narrow", "select"}
# what a state goes through, its dims kept, on its way to the cat that takes it: copies, casts, pads
_THROUGH = {"clone", "contiguous", "detach", "alias", "_to_copy", "to", "pad", "constant_pad_nd", "lift_fresh_copy"}
_VIEWS_KEPT = {"slice", "narrow", "alias", "getitem", "split", "split_with_sizes", "chunk"}  # views in the state's dims
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}


@dataclass(frozen=True)
class CatFact:
    node: str
    dim: int | None  # None: the cat takes a reshaped view of the state (its dims are not the state's)
    position: int  # among the operands that are not legacy-empty (``torch.tensor([])``)
    operands: int
    added: int | None  # extent the other operands contribute along ``dim``
    via: tuple[str, ...] = ()  # the ops the state went through to become the operand (none: the state itself)
    feeds_output: bool = False  # the state's output is cut from this cat (slices, copies of it)

    def through(self) -> str:
        """``, reached through aten.pad`` (empty for the state itself): for the evidence."""
        ops = [f"aten.{op}" + (" of it alone" if op == "cat" else "") for op in self.via]
        return f", reached through {', '.join(ops)}" if ops else ""


@dataclass(frozen=True)
class WriteFact:
    node: str
    op: str
    dim: int | None  # None: the write covers the whole state
    count: int | None  # positions written along ``dim`` per call


def placeholder(ep: ExportedProgram, name: str) -> Node | None:
    return next((n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name), None)


def node_named(ep: ExportedProgram, name: str) -> Node | None:
    return next((n for n in ep.graph.nodes if n.name == name), None)


def cats_of(ep: ExportedProgram, ph: Node, output: Node | None = None) -> list[CatFact]:
    """Every ``aten.cat`` the state ``ph`` reaches as an operand: itself, or what it becomes through cuts,
    copies, pads, views and pointwise ops (``cat([pad(cache), new])``). A legacy-empty operand
    (``torch.tensor([])``, which ``torch.cat`` skips) is not counted, and a cat of the state alone is a copy
    of it, followed on. First the cats ``output`` (the state's output node) is cut from, then the ones
    that take a view of the state, each in graph order; a cat reached through a pointwise op (the state
    computed with) counts only when the output is cut from it."""
    rank = len(shape_of(ph) or ())
    cut = _cut_from(output)
    order = {n: i for i, n in enumerate(ep.graph.nodes)}
    found: list[tuple[tuple[bool, bool, int], CatFact]] = []
    seen = {ph}
    frontier: deque[tuple[Node, bool, bool, tuple[str, ...]]] = deque([(ph, True, False, ())])
    while frontier:
        node, keeps, computed, via = frontier.popleft()
        for u in node.users:
            if u in seen or u.op != "call_function":
                continue
            op = overload_name(u)
            if op == "cat":
                parts = cat_operands(u)
                if node not in parts or (computed and len(parts) > 1 and u not in cut):
                    continue
                seen.add(u)
                if len(parts) == 1:
                    frontier.append((u, keeps, computed, via + ("cat",)))
                    continue
                pos = parts.index(node)
                dim = cat_dim(u) if keeps else None
                sizes = [_size(q, dim) for i, q in enumerate(parts) if i != pos] if dim is not None else [None]
                added = sum(x for x in sizes if x is not None) if None not in sizes else None
                direct = view_root(node) is ph
                found.append(((u not in cut, not direct, order[u]),
                              CatFact(u.name, dim, pos, len(parts), added, via, u in cut)))
                continue
            step = _follows(u, node, rank)
            if step is not None:
                seen.add(u)
                frontier.append((u, keeps and step[0], computed or step[1], via + (_op(u),)))
    return [f for _key, f in sorted(found, key=lambda kf: kf[0])]


def cat_operands(cat: Node) -> list[object]:
    """The operands of an ``aten.cat`` less the legacy-empty ones (1-d with no elements: ``torch.cat`` skips them)."""
    return [p for p in _arg(cat, 0, "tensors", ()) if shape_of(p) != (0,)]


def _follows(u: Node, src: Node, rank: int) -> tuple[bool, bool] | None:
    """How the state, as ``src``, goes on into ``u``: (its dims kept, computed with by a pointwise op), or
    None where ``u`` makes something else of it."""
    op = _op(u)
    same = len(shape_of(u) or ()) == rank
    if op in _THROUGH:
        return (same, False) if u.args and u.args[0] is src else None
    if op in _SPLITS or is_view(u):
        if not u.args or u.args[0] is not src:
            return None
        return (op != "unbind" if op in _SPLITS else same and op in _VIEWS_KEPT), False
    if isinstance(u.target, torch._ops.OpOverload) and torch.Tag.pointwise in u.target.tags and src in u.args:
        return same, True
    return None


def _op(n: Node) -> str:
    return overload_name(n) or ("getitem" if n.target is operator.getitem else "")


def _cut_from(output: Node | None) -> set[Node]:
    """The nodes ``output`` is a cut or copy of, down to the first cat of several operands (included)."""
    cut: set[Node] = set()
    node: object = output
    while isinstance(node, Node) and node.op == "call_function" and node not in cut and node.args:
        cut.add(node)
        op = overload_name(node)
        if op == "cat":
            parts = cat_operands(node)
            if len(parts) != 1:
                break
            node = parts[0]
        elif op in _THROUGH or (is_view(node) and _op(node) in _VIEWS_KEPT):
            node = node.args[0]
        else:
            break
    return cut


def writes_of(ep: ExportedProgram, ph: Node) -> list[WriteFact]:
    """Every write of positions of ``ph``: in place, or as a functional update that replaces it."""
    rank = len(shape_of(ph) or ())
    facts = []
    for n in ep.graph.nodes:
        op = overload_name(n) if n.op == "call_function" else ""
        if op not in _WRITES or not n.args or _origin(n.args[0]) is not ph:
            continue
        dim, count = _extent(n, op.rstrip("_"), rank, ph)
        facts.append(WriteFact(n.name, op, dim, count))
    return facts


def _origin(x: object) -> Node | None:
    """The tensor ``x`` holds positions of: through views, in-place returns and functional updates."""
    while True:
        root = storage_root(x)
        if root is None or root.op != "call_function" or overload_name(root) not in _UPDATES:
            return root
        x = root.args[0]


def _arg(n: Node, i: int, name: str, default: Any = None) -> Any:
    """An argument of ``n`` given positionally or by name (FX keeps either, as the call was written)."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _size(x: object, d: int = 0) -> int | None:
    s = shape_of(x)
    return s[d] if s is not None and len(s) > d else None


def _extent(n: Node, op: str, rank: int, ph: Node) -> tuple[int | None, int | None]:
    def norm(d: Any) -> int:
        return int(d) % rank if rank else int(d)

    if op in ("index_copy", "index_fill"):
        return norm(_arg(n, 1, "dim")), _size(_arg(n, 2, "index"))
    if op == "scatter":
        d = norm(_arg(n, 1, "dim"))
        return d, _size(_arg(n, 2, "index"), d)
    if op == "index_put":
        indices = list(_arg(n, 1, "indices", ()))
        first = next((i for i, t in enumerate(indices) if t is not None), None)
        return (first, _size(indices[first])) if first is not None else (None, None)
    if op in ("slice_scatter", "select_scatter"):
        d = norm(_arg(n, 2, "dim", 0))
        return d, (_size(_arg(n, 1, "src"), d) if op == "slice_scatter" else 1)
    return _restricted_dim(n.args[0], ph, rank)  # copy_ into a view of the state


def _restricted_dim(dst: object, ph: Node, rank: int) -> tuple[int | None, int | None]:
    """The dim a ``copy_`` destination view narrows (``cache[:, a:b] = new``), in the state's dims."""
    chain = []
    node = dst
    while isinstance(node, Node) and node is not ph and node.op == "call_function" and node.args:
        chain.append(node)
        node = node.args[0]
    for v in reversed(chain):  # from the state outwards: dims stay the state's until the rank changes
        src, out = shape_of(v.args[0]), shape_of(v)
        op = overload_name(v)
        if src is None or out is None or len(src) != rank:
            break
        if op in _RESTRICTING:
            d = int(_arg(v, 1, "dim", 0)) % rank
            if op == "select":
                return d, 1
            if out[d] < src[d]:
                return d, out[d]
        elif out != src:  # a reshape: its dims are no longer the state's
            break
    return None, None


def mutated_buffers(ep: ExportedProgram) -> dict[str, tuple[Node, list[WriteFact], bool | None]]:
    """Module buffers the program writes: fqn -> (placeholder, writes, carried). ``carried``: a call
    reads what an earlier call left (state), False: written before read every call (scratch), None:
    not known (the write is a functional update export returns as a buffer mutation)."""
    sig = ep.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    written = {}
    for ph_name, fqn in sig.inputs_to_buffers.items():
        ph = placeholder(ep, ph_name)
        writes = writes_of(ep, ph) if ph is not None else []
        if ph is not None and (writes or fqn in mutated):
            written[fqn] = (ph, writes)
    carried = attribute_writes(ep.module()) if written else {}  # unlifting costs a module copy: only when needed
    return {fqn: (ph, writes, carried.get(fqn)) for fqn, (ph, writes) in written.items()}
