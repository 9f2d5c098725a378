"""The slice box each use of a tensor can touch, and whether a union of boxes covers another.

A use of a buffer reached through ``slice`` / ``narrow`` / ``select`` chains with constant indices
touches one box of it (a ``[start, end)`` range per dim); any other use than those chains touches
the box of the view it sees, and an ``as_strided``-like use can escape any box. From these boxes
``shrink_workspace`` sizes a workspace to what a step can reach, and ``envelope_state`` proves that
every read of a workspace sees only positions the same call wrote before it (:func:`box_covered`).
Where such a proof also needs a read's bits not to depend on the layout, :func:`stride_independent`
says whether they do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.fx import Node

from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.ops import MOVES, is_mutating, is_view_op, overload_name

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
    return name in MOVES


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
