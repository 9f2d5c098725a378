"""What kind of op an FX node is, read from its ATen schema and tags.

Every pass asks the same few questions of a node before it moves, rewrites or orders it: does it
return a view (an alias it does not write), write one of its arguments (and which), draw from a
generator, only move data, or is it the export's shape guard. The answers come from the op's
schema (``alias_info``, ``is_mutable``, ``out=`` arguments) and tags (``nondeterministic_seeded``),
so one table of names is needed only where the schema cannot say it (the ops that only move data,
the dropouts that draw nothing in eval mode).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

aten = torch.ops.aten

#: ATen ops that only move data (no arithmetic): what building a region's outgoing state costs
#: (:mod:`~cadence_fx.analysis.traffic`), and reads whose result does not depend on the source's strides
#: (:func:`~cadence_fx.analysis.boxes.stride_independent`).
MOVES = frozenset({"cat", "clone", "contiguous", "copy", "_to_copy", "index_copy", "scatter", "index_put",
                   "index_fill", "slice_scatter", "select_scatter", "stack", "narrow_copy", "index_select",
                   "constant_pad_nd"})


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
        return node.op == "call_function" and t.__name__ == "getitem" and returns_views(node.args[0])
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def returns_views(node: object) -> bool:
    """A ``split`` / ``chunk`` / ``unbind``: a list of views of its input (each item, a ``getitem``, is a view)."""
    return isinstance(node, Node) and overload_name(node) in {"split", "split_with_sizes", "chunk", "unbind"}


def is_view_op(node: Node) -> bool:
    """:func:`is_view`, or any ``getitem`` (an item of a list of views or of an op's several results)."""
    return is_view(node) or node.target is operator.getitem


def is_mutating(node: Node) -> bool:
    """An ATen op whose schema writes one of its arguments (in place, or ``out=``)."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def is_out_op(node: Node) -> bool:
    """An ``out=`` overload called with its ``out`` tensor (computes into it; reads nothing of it)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or "out" not in node.kwargs:
        return False
    args = t._schema.arguments
    return bool(args) and args[-1].name == "out" and args[-1].kwarg_only


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


def is_export_guard(mod: object) -> bool:
    """torch.export's input guard: the module ``ep.module()`` attaches as ``_guards_fn`` and calls on the
    inputs first, a generated checker of the sizes the program was specialised to (it reads shapes,
    never elements). Told by its class, ``torch.export._unlift.GuardsFn`` (named, not imported: private)."""
    return type(mod).__name__ == "GuardsFn"


def is_guard(node: Node) -> bool:
    """A call of torch.export's input guard (:func:`is_export_guard`) in the graph of a module."""
    if node.op != "call_module":
        return False
    owner = node.graph.owning_module
    try:
        return owner is not None and is_export_guard(owner.get_submodule(str(node.target)))
    except AttributeError:  # not a submodule of the module that owns the graph
        return False


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
    memory-efficient, cuDNN), nor do those kernels' own ops, which an export on a GPU may hold in its
    place. A kernel that moved the generator anyway would be caught by the capture probe
    (``found_by_probe`` in the counters) and replayed as one that draws. Models in eval mode keep both
    in their exported graphs, and treating them as draws would order every replay that holds one after
    every other lane's (the session streams of :mod:`cadence_fx.runtime.rng`, one lock) and make each a
    fence for parallel branches.
    """
    if not is_random(node):
        return False
    name = overload_name(node)
    if name in _DROPOUTS:
        return not (_zero(_literal(node, 1, "p")) or _literal(node, 2, "train") is False)
    if "attention" in name:
        # SDPA and the fused kernels it dispatches to (flash, memory-efficient, cuDNN, CPU flash: what
        # the autocast block holds once inline_autocast has lowered it), by their schema's dropout_p
        schema = node.target._schema  # type: ignore[union-attr]
        where = next((i for i, a in enumerate(schema.arguments) if a.name == "dropout_p"), None)
        if where is not None:
            default = schema.arguments[where].default_value
            return not _zero(_literal(node, where, "dropout_p", default))
    return True
