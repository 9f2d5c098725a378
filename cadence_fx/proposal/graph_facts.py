"""What the exported graph says about a state tensor: the cats that take it, the writes into it.

The eager replay shows values, not intent: the concatenation order a pass must reproduce and the
positions an in-place write names are read here, off ``torch.export``'s graph, with the node names a
user can look up in ``print(ep.graph)``. The state is a placeholder (a user input, or a module buffer
lifted by export); a functional update of it (``index_copy``, ``slice_scatter`` after
``run_decompositions``) counts as a write of it, as the in-place form does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.export import ExportedProgram
from torch.fx import Node

from cadence_fx.analysis.aliases import storage_root, view_root
from cadence_fx.analysis.graph_io import cat_dim, shape_of
from cadence_fx.analysis.ops import overload_name
from cadence_fx.analysis.writes import attribute_writes

# functional updates: a new tensor that is the state with some positions replaced
_UPDATES = {"index_copy", "scatter", "index_put", "index_fill", "slice_scatter", "select_scatter"}
_WRITES = _UPDATES | {u + "_" for u in _UPDATES if not u.endswith("_scatter")} | {"copy_"}
# views that restrict one dim of their input, given as their second argument
_RESTRICTING = {"slice", "narrow", "select"}


@dataclass(frozen=True)
class CatFact:
    node: str
    dim: int | None  # None: the cat takes a reshaped view of the state (its dims are not the state's)
    position: int
    operands: int
    added: int | None  # extent the other operands contribute along ``dim``


@dataclass(frozen=True)
class WriteFact:
    node: str
    op: str
    dim: int | None  # None: the write covers the whole state
    count: int | None  # positions written along ``dim`` per call


def placeholder(ep: ExportedProgram, name: str) -> Node | None:
    return next((n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name), None)


def cats_of(ep: ExportedProgram, ph: Node) -> list[CatFact]:
    """Every ``aten.cat`` with ``ph`` (or a view of it of the same shape) among its operands."""
    facts = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or overload_name(n) != "cat":
            continue
        parts = list(_arg(n, 0, "tensors", ()))
        for pos, p in enumerate(parts):
            if not isinstance(p, Node) or (p is not ph and view_root(p) is not ph):
                continue
            dim = cat_dim(n) if _keeps_dims(p, ph) else None
            sizes = [_size(q, dim) for i, q in enumerate(parts) if i != pos] if dim is not None else [None]
            added = sum(x for x in sizes if x is not None) if None not in sizes else None
            facts.append(CatFact(n.name, dim, pos, len(parts), added))
            break
    return facts


def _keeps_dims(view: Node, ph: Node) -> bool:
    """Whether ``view`` indexes like ``ph``: ``ph`` itself, or slices of it that keep its rank (a per-step
    slot ``cache[s:s + 1]``), so a dim of the cat is a dim of the state."""
    rank = len(shape_of(ph) or ())
    node: object = view
    while node is not ph:
        if not isinstance(node, Node) or overload_name(node) not in ("slice", "narrow", "alias", "contiguous") \
                or len(shape_of(node) or ()) != rank:
            return False
        node = node.args[0]
    return True


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
