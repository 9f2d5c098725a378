"""Which tensor a graph value lives in: the node it is a view of, the tensor an in-place op wrote.

ATen in-place ops return their (written) first argument and ``out=`` ops their ``out`` tensor, and
views share their base's storage, so two nodes of one graph can name one buffer. The state passes
ask this before they merge storages (``ring_in_place``), move a write (``retention_in_place``) or
count the bytes written into a state (:mod:`~cadence_fx.analysis.traffic`).
"""

from __future__ import annotations

from torch.fx import Node

from cadence_fx.analysis.ops import is_mutating, is_out_op, is_view, returns_views


def view_root(node: object) -> Node | None:
    """The non-view node that ``node`` is (transitively) a view of."""
    while isinstance(node, Node) and (is_view(node) or returns_views(node)):
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


def storage_root(node: object) -> Node | None:
    """The node whose storage ``node`` lives in: through views and through in-place ops' returns."""
    while True:
        root = view_root(node)
        written = written_in_place(root)
        if written is root:
            return root
        node = written
