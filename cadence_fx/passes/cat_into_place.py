"""A concatenation made only to be copied into a buffer -> concatenated straight into that buffer.

``dst.copy_(torch.cat(pieces, dim))`` runs two kernels: the cat into a temporary, then the copy into
``dst``. Streaming code writes its new caches this way (the estimator stores each layer's new
attention and convolution caches into its solver workspace so), and the state rule leaves such
copies where a region or workspace slice is the destination. ``cat.out(pieces, dim, out=dst)`` is
one kernel and no temporary. Both only move elements, so ``dst`` ends with the same bytes.

Rewritten only where that is provable from the graph:
- the cat has no other use than the copy;
- ``dst`` has the cat's shape and dtype (a copy that broadcasts or converts stays);
- no piece can share memory with ``dst``: every piece is (a view of) a tensor the graph computes
  afresh (an op whose schema returns no alias and that has a kernel of its own, or a composite known
  to allocate: :func:`_allocates`), and that tensor is not what ``dst`` views;
- no in-place write between the cat and the copy can reach a piece (the pieces are now read where
  the copy was).
The count of rewrites is the pass's stat; a graph without the pattern is unchanged.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.ops import is_mutating, is_view, overload_name, written_args
from cadence_fx.passes import PassContext

_CAT_OUT = torch.ops.aten.cat.out


def cat_into_place(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Fuse ``copy_(dst, cat(pieces))`` into ``cat.out(pieces, out=dst)`` where provably the same bytes."""
    graph = gm.graph
    fused = 0
    for copy in list(graph.nodes):
        if copy.op != "call_function" or overload_name(copy) != "copy_" or len(copy.args) != 2 \
                or copy.kwargs.get("non_blocking"):
            continue
        dst, cat = copy.args
        if not (isinstance(cat, Node) and isinstance(dst, Node) and cat.target == torch.ops.aten.cat.default
                and len(cat.users) == 1):
            continue
        if not _same_shape_and_dtype(dst, cat):
            continue
        pieces, dim = cat.args[0], (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0))
        if not isinstance(pieces, (list, tuple)) or not pieces or not all(isinstance(p, Node) for p in pieces):
            continue
        dst_root = view_root(dst)
        roots = [_fresh_root(p) for p in pieces]
        if any(r is None or r is dst_root for r in roots):
            continue
        if _writes_between(cat, copy, set(roots)):
            continue
        with graph.inserting_before(copy):
            out = graph.call_function(_CAT_OUT, (list(pieces), dim), {"out": dst})
        out.meta.update(copy.meta)
        copy.replace_all_uses_with(out)
        graph.erase_node(copy)
        graph.erase_node(cat)
        fused += 1
    if fused:
        graph.lint()
    ctx.record("cat_into_place", fused)
    return gm


def _writes_between(first: Node, last: Node, roots: set[Node]) -> bool:
    """Whether a node after ``first`` and before ``last`` may write into one of ``roots`` (fresh
    tensors: only a write through a view of one of them can reach it; one whose destination is
    not followed to a node is taken as a write into them)."""
    n = first.next
    while n is not last:
        if n.op == "call_function" and is_mutating(n):
            dests = written_args(n)
            if not dests or any(not isinstance(d, Node) or view_root(d) in roots or view_root(d) is None
                                for d in dests):
                return True
        n = n.next
    return False


def _same_shape_and_dtype(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape \
        and va.dtype == vb.dtype and va.device == vb.device


def _fresh_root(node: Node) -> Node | None:
    """The node whose freshly allocated output ``node`` views, or None when it may alias anything else
    (a graph input, a module attribute, an op whose schema returns an alias or writes)."""
    root = view_root(node)
    if root is None or root.op != "call_function":
        return None
    if root.target is operator.getitem:  # one output of a multi-output op that allocates them all
        src = root.args[0]
        return root if isinstance(src, Node) and _allocates(src) else None
    return root if _allocates(root) else None


# Composite ops whose every path computes a new tensor. Other composite ops may hand back an input
# despite a schema without an alias annotation (``dropout`` in eval returns its input; ``type_as`` of
# the same dtype too): their output is not taken as fresh.
_COMPOSITE_ALLOCATING = frozenset({"linear", "layer_norm", "matmul", "conv1d", "conv2d", "conv_transpose1d",
                                   "group_norm", "softmax", "log_softmax", "scaled_dot_product_attention"})


def _allocates(node: Node) -> bool:
    """Whether ``node``'s outputs are new memory: an ATen op whose schema returns no alias, with a
    kernel of its own (not a composite that may return an input), or a composite known to allocate."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or is_mutating(node) or is_view(node):
        return False
    if not all(r.alias_info is None for r in t._schema.returns):
        return False
    composite = t.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    return not composite or overload_name(node) in _COMPOSITE_ALLOCATING
