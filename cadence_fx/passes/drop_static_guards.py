"""Drop torch.export's input guard from a program exported with static shapes.

``ep.module()`` starts with a call of ``_guards_fn``: one Python ``torch._assert`` per input size (and
per relation export recorded), run before anything else on every call. An optimized program never
reaches its graph without the catalog's dispatch (:mod:`cadence_fx.runtime.catalog`) first matching
the call's exact signature: every tensor's whole shape and dtype, every Python scalar's value. When
no input of the program is symbolic, that match implies every condition the guard asserts, so the
guard only adds host time before the first kernel of every call. A program with any symbolic size or
scalar keeps its guard (ranges and relations are the guard's to check).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from cadence_fx.analysis.ops import is_guard
from cadence_fx.passes import PassContext


def drop_static_guards(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Erase the input guard calls of ``gm`` when every placeholder's value is static."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    guards = [n for n in gm.graph.nodes if is_guard(n) and not n.users]
    if not guards or not all(_static(n) for n in placeholders):
        return gm
    # only the calls go: the unlifted module's forward pre-hook (torch.export's) checks every input
    # against the exported constraints itself unless the module has a ``_guards_fn`` to defer to, and
    # that check knows only the stock shapes (a live-sized region would fail it)
    for n in guards:
        gm.graph.erase_node(n)
    ctx.record("drop_static_guards", len(guards))
    return gm


def _static(ph: Node) -> bool:
    """``ph`` was traced with a concrete value: a tensor whose every size is an int, or a plain scalar."""
    if "val" not in ph.meta:
        return False  # nothing says what the guard checks here: keep it
    val = ph.meta["val"]
    if isinstance(val, torch.Tensor):
        return all(type(s) is int for s in val.shape)
    return val is None or type(val) in (bool, int, float, str)
