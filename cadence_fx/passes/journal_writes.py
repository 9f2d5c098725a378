"""Journal writes: before each in-place write into a region's bytes, save the bytes it overwrites.

A call is a transaction for the state (:mod:`cadence_fx.runtime.transaction`): one that raises must
leave every region as before it. When the state lives where the call writes it (the default
session's lane 0, a pinned session's lane), the undo used to copy every region whole before each
call, so a call moved each region's bytes once more than the stock program, which writes one slot
of a ring or appends a few frames. This pass puts, right before each write into a region's storage,
a copy of exactly the elements the write is about to overwrite into a small program-owned buffer
(the *journal*), and marks the entry done in a flag buffer. Both sit inside the captured graphs, so
they cost one small gather per write and no host work. If the call raises, the runtime walks the
journal backwards and puts back every entry whose flag is set (:func:`journal_rollback`): the
regions' bytes are those before the call, including positions the call wrote beyond the live state.

A write is journaled when its destination is reached from the region's input or buffer through
view ops with constant arguments (the runtime replays that chain on the same tensor) and its shape
and dtype are known:
- ``scatter_`` (``src`` or ``value``, no reduction): the gathered elements and the index;
- ``index_copy_`` / ``index_fill_``: the selected slices and the index;
- any other write (``copy_``, ``fill_``, an ``out=`` op, ...): the whole destination view.
A region with any other write into its storage (a destination built from data, a symbolic shape)
is listed in :attr:`WriteJournal.whole`: the runtime copies that region whole before the call, as
before. The runtime zeroes the flags before every call it may have to undo.
"""

from __future__ import annotations

import itertools

from typing import Any, Mapping, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from cadence_fx.analysis.aliases import storage_root, written_in_place
from cadence_fx.analysis.graph_io import numel, register_tensor, shape_of
from cadence_fx.analysis.ops import aten, is_mutating, is_view, overload_name, written_args
from cadence_fx.annotations import JOURNAL_PREFIX
from cadence_fx.passes import PassContext
from cadence_fx.runtime.journal import JournalEntry, WriteJournal

__all__ = ["journal_writes"]

_WHOLE_FACTOR = 2  # journal bytes over state bytes above which a region is copied whole instead

# in-place ops whose written elements an index names: (gather op that reads them, where the dim and index are)
_INDEXED = {
    "scatter_": aten.gather.default,
    "index_copy_": aten.index_select.default,
    "index_fill_": aten.index_select.default,
}


def journal_writes(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Journal every in-place write into a region's storage that can be replayed from its root."""
    facts = ctx.program
    if not ctx.config.state_rule or not facts.regions:
        return gm
    if not ctx.config.journal:  # the undos copy every region whole (journal None)
        return gm
    graph = gm.graph
    roots: dict[Node, tuple[str, str]] = {}
    for name, rs in facts.regions.items():
        roots[rs.placeholder] = (name, "input")
    for n in graph.nodes:
        if n.op == "get_attr":
            for name, rs in facts.regions.items():
                if n.target == rs.buffer_attr:
                    roots[n] = (name, "buffer")
    writes: list[tuple[Node, Node, str, str]] = []
    whole: set[str] = set()
    for n in graph.nodes:
        if n.op != "call_function" or not is_mutating(n):
            continue
        for w in written_args(n):
            root = storage_root(w) if isinstance(w, Node) else None
            if root in roots:
                name, kind = roots[root]
                writes.append((n, w, name, kind))
    plans = []
    for n, w, name, kind in writes:
        plan = _plan(n, w, roots, facts.region_buffers)
        if plan is None:
            whole.add(name)
        else:
            plans.append((n, w, name, kind, plan))
    # a region whose journal would save far more bytes than its state (a compaction stages and
    # rewrites the window) is copied whole once instead; below that the journal wins even at more
    # bytes: it runs inside the graphs, where a whole copy is one more host operation per region and call
    saved: dict[str, int] = {}
    for n, w, name, kind, (op_kind, _c, _d, index, shape, dtype) in plans:
        idx = shape_of(index) if index is not None else None
        saved[name] = saved.get(name, 0) + _nbytes(shape, dtype) + (_nbytes(idx, torch.int64) if idx else 0)
    for name, b in saved.items():
        ph = facts.regions[name].placeholder
        val = ph.meta.get("val")
        state = _nbytes(shape_of(ph), val.dtype) if isinstance(val, torch.Tensor) and shape_of(ph) is not None else None
        if state is not None and b > _WHOLE_FACTOR * state:
            whole.add(name)
    plans = [p for p in plans if p[2] not in whole]  # a region undone whole needs no entries
    if not plans:
        facts.journal = WriteJournal(None, (), frozenset(whole))
        return gm
    device = facts.region_buffers[plans[0][2]].device if plans[0][2] in facts.region_buffers else None
    flags = torch.zeros(len(plans), dtype=torch.bool, device=device)
    flags_attr = register_tensor(gm, f"{JOURNAL_PREFIX}flags_", flags)
    entries = []
    for slot, (n, w, name, kind, (op_kind, chain, dim, index, shape, dtype)) in enumerate(plans):
        old_attr = register_tensor(gm, f"{JOURNAL_PREFIX}old_", torch.zeros(shape, dtype=dtype, device=device))
        idx_attr = None
        with graph.inserting_before(n):
            first = n.prev  # the nodes made below sit between this one and the write
            old = _get_attr(gm, old_attr)
            if op_kind == "view":
                saved: Node = w
            else:
                saved = graph.call_function(_INDEXED[op_kind], (w, dim, index))
                _fake(saved, _INDEXED[op_kind], (w, dim, index))
                idx_shape, idx_dtype = shape_of(index), index.meta["val"].dtype
                idx_attr = register_tensor(gm, f"{JOURNAL_PREFIX}index_",
                                           torch.zeros(idx_shape, dtype=idx_dtype, device=device))
                _copy(graph, _get_attr(gm, idx_attr), index)
            _copy(graph, old, saved)
            flags = _get_attr(gm, flags_attr)
            flag = graph.call_function(aten.select.int, (flags, 0, slot))
            _fake(flag, aten.select.int, (flags, 0, slot))
            done = graph.call_function(aten.fill_.Scalar, (flag, True))
            done.meta["val"] = flag.meta.get("val")
        adopt_meta(first, n)
        entries.append(JournalEntry(name, kind, chain, op_kind, dim, old_attr, idx_attr, slot))
    facts.journal = WriteJournal(flags_attr, tuple(entries), frozenset(whole))
    ctx.record("journal_writes", len(entries))
    return gm


def adopt_meta(first: Node, write: Node) -> None:
    """The journal's nodes (after ``first``, up to ``write``) take the write's meta: they belong where
    the write does, its wrapped invocation, so its partition. (Without it the partition once cut the
    invocation between a region's view and its write; the replay hands such views back as views,
    ``runtime.output_views``, so that cut is exact too, only slower.)"""
    new = first.next
    while new is not write:
        for k, v in write.meta.items():
            if k != "val":
                new.meta.setdefault(k, v)
        new = new.next


def _plan(n: Node, w: Node, roots: Mapping[Node, tuple[str, str]], buffers: Mapping[str, torch.Tensor]
          ) -> tuple | None:
    """How to journal write ``n`` into ``w``: (kind, view chain, dim, index node, saved shape, dtype), or None."""
    found = _chain(w, roots)
    if found is None:
        return None
    chain, root = found
    dest = _destination(chain, root, roots, buffers)
    if dest is None:
        return None
    base, overload = overload_name(n), n.target._overloadname
    if base in _INDEXED and n.args and n.args[0] is w and "reduce" not in n.kwargs and len(n.args) >= 3 \
            and (base != "scatter_" or overload in ("src", "value")):
        dim, index = n.args[1], n.args[2]
        ival = index.meta.get("val") if isinstance(index, Node) else None
        if not isinstance(dim, int) or not isinstance(ival, torch.Tensor) or shape_of(index) is None:
            return None
        dim = dim % max(dest.dim(), 1)
        if base == "scatter_":
            shape = shape_of(index)
        else:
            shape = tuple(s if d != dim else ival.numel() for d, s in enumerate(dest.shape))
        return base, chain, dim, index, shape, dest.dtype
    return "view", chain, None, None, tuple(dest.shape), dest.dtype


def _destination(chain: tuple, root: Node, roots: Mapping[Node, tuple[str, str]],
                 buffers: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The write's destination as a meta tensor: the chain replayed on the root's shape (the graph's
    recorded values miss on nodes earlier passes added). None where the root's shape is not known."""
    name, kind = roots[root]
    if kind == "buffer":
        base = buffers.get(name)
        if base is None:
            return None
        t = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device="meta")
    else:
        val = root.meta.get("val")
        if not isinstance(val, torch.Tensor) or shape_of(root) is None:
            return None
        t = torch.empty(shape_of(root), dtype=val.dtype, device="meta")
    try:
        for op, args, kwargs in chain:
            t = op(t, *args, **dict(kwargs))
    except Exception:  # noqa: BLE001 - a view the meta replay refuses: not journaled
        return None
    return t if isinstance(t, torch.Tensor) else None


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return numel(shape) * dtype.itemsize


def _chain(w: Node, roots: Mapping[Node, tuple[str, str]]) -> tuple[tuple, Node] | None:
    """The view ops (constant arguments only) from a root to ``w``, and the root; None if ``w`` is
    reached otherwise."""
    chain = []
    node = w
    while node not in roots:
        if not isinstance(node, Node) or node.op != "call_function":
            return None
        if is_mutating(node):  # an in-place op's return is the tensor it wrote
            written = written_in_place(node)
            if written is None or written is node:
                return None
            node = written
            continue
        if not is_view(node) or not node.args or not isinstance(node.args[0], Node):
            return None
        rest = node.args[1:]
        consts = _flatten(rest) + _flatten(node.kwargs.values())
        if any(isinstance(a, Node) for a in consts) \
                or any(not isinstance(a, (int, float, bool, type(None), torch.dtype, torch.memory_format))
                       for a in _flatten(rest)):
            return None
        chain.append((node.target, tuple(rest), tuple(sorted(node.kwargs.items()))))
        node = node.args[0]
    return tuple(reversed(chain)), node


def _flatten(xs: Sequence[Any] | Any) -> list[Any]:
    out = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out += _flatten(x)
        else:
            out.append(x)
    return out


def _get_attr(gm: GraphModule, attr: str) -> Node:
    node = gm.graph.get_attr(attr)
    t = getattr(gm, attr)
    node.meta["val"] = _fake_mode_tensor(gm, t)
    return node


def _copy(graph: Any, dst: Node, src: Node) -> Node:
    node = graph.call_function(aten.copy_.default, (dst, src))
    node.meta["val"] = dst.meta.get("val")
    return node


def _fake_mode_tensor(gm: GraphModule, t: torch.Tensor) -> Any:
    mode = _mode(gm)
    return mode.from_tensor(t) if mode is not None else None


def _mode(gm: GraphModule) -> Any:
    # the first recorded values name the graph's fake mode: walking every node per journal buffer
    # would make the pass quadratic in a 7B LM's graph
    vals = list(itertools.islice((n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)),
                                 64))
    try:
        return detect_fake_mode(vals)
    except Exception:  # noqa: BLE001 - no fake mode: the nodes go without a value
        return None


def _fake(node: Node, op: Any, args: tuple) -> None:
    vals = [a.meta.get("val") if isinstance(a, Node) else a for a in args]
    if any(isinstance(a, Node) and not isinstance(v, torch.Tensor) for a, v in zip(args, vals)):
        return
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return
    with mode:
        node.meta["val"] = op(*vals)
