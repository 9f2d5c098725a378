"""Drop empty cat operands: ``cat([torch.tensor([]), cache], d)`` is ``cat([cache], d)``.

``torch.cat`` skips a one-dimensional tensor with no elements whatever the other operands' shapes
(a legacy rule kept for code that starts a running cat from ``torch.tensor([])``: transformers'
``DynamicLayer`` does when a cache is rebuilt from tensors). Such an operand changes nothing but
the result's dtype, through type promotion, so it is dropped only where its dtype is the result's.
Without it the cache is the cat's first operand again, and a cat of one operand is a contiguous
copy of it: the state passes then see the append order the model means, not a cache in the middle.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from cadence_fx.analysis.ops import aten
from cadence_fx.passes import PassContext


def drop_empty_cat_operands(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Remove the legacy-empty operands of every ``aten.cat`` whose dtype they do not change."""
    graph = gm.graph
    changed = 0
    for cat in list(graph.find_nodes(op="call_function", target=aten.cat.default)):
        parts = list(cat.args[0])
        val = cat.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        kept = [p for p in parts if not _legacy_empty(p, val.dtype)]
        if len(kept) == len(parts) or not kept:
            continue
        if len(kept) == 1:  # a cat of one tensor: a contiguous copy of it, the same bits
            with graph.inserting_before(cat):
                copy = graph.call_function(aten.clone.default, (kept[0],), {"memory_format": torch.contiguous_format})
            copy.meta = dict(cat.meta)
            cat.replace_all_uses_with(copy)
            graph.erase_node(cat)
        else:
            cat.args = (kept, *cat.args[1:])
        changed += len(parts) - len(kept)
    graph.eliminate_dead_code()
    ctx.record("drop_empty_cat_operands", changed)
    return gm


def _legacy_empty(node: object, dtype: torch.dtype) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == 0 and val.dtype == dtype
