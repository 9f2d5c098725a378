"""Lower ``wrap_with_autocast`` regions to the casts autocast makes, spliced into the parent graph.

torch.export records a ``with torch.autocast(...):`` block inside the model (the Token2Wav
driver's float16 switch puts the whole flow in one) as a higher-order op over a subgraph whose
ops are still the user-level ones; the casts happen only when the op runs under autocast. The
other passes cannot see into the subgraph (no cache update, no wrapped callable, no constant is
visible), so the region is retraced once, under the same autocast, below the autocast dispatch
key: the result holds each cast autocast makes as an explicit ``_to_copy`` and the ops as they
reach the kernels. It is the computation eager runs under autocast, op for op, so the bytes are
the same; every retraced node keeps the metadata (``nn_module_stack``, stack trace) of the
node it came from, so wrapped callables are still found.
"""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.proxy_tensor import make_fx

from cadence_fx.analysis.graph_io import fetch_attr
from cadence_fx.passes import PassContext
from cadence_fx.passes.inline_grad_regions import hop_calls, splice_subgraph


def inline_autocast(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace every ``wrap_with_autocast`` node by its retraced, explicitly cast subgraph."""
    lowered = 0
    for node in hop_calls(gm, "wrap_with_autocast"):
        device_type, dtype, enabled, cache_enabled, sub_node, *operands = node.args
        sub = getattr(gm, sub_node.target)
        vals = [_meta_value(a, gm) for a in operands]
        key = (sub.code, device_type, dtype, enabled, cache_enabled,
               tuple((tuple(v.shape), v.stride(), v.dtype, str(v.device), v.requires_grad)
                     if isinstance(v, torch.Tensor) else repr(v) for v in vals))
        traced = ctx.tables.retraced.get(key)
        if traced is None:
            traced = ctx.tables.retraced[key] = _retrace(sub, vals, device_type, dtype, enabled, cache_enabled)
        splice_subgraph(gm, node, traced, operands)
        lowered += 1
    gm.graph.eliminate_dead_code()
    ctx.record("inline_autocast", lowered)
    return gm


def _retrace(sub: GraphModule, vals: list, device_type: str, dtype: torch.dtype | None,
             enabled: bool, cache_enabled: bool | None) -> GraphModule:
    """``sub`` traced at the ATen level under ``autocast(device_type, dtype, enabled, cache_enabled)``
    on fake tensors shaped like the operand values ``vals``; each new node keeps the meta of the node
    it came from."""
    # a fresh mode without a shape environment: the program has static shapes, and tracing with
    # export's symbolic machinery costs many times as long for the same graph
    # ``requires_grad`` is copied too: ATen's ``matmul`` picks its kernels by it (it folds batch
    # dims into one ``mm`` only when the weight does not require grad), even under no_grad
    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).requires_grad_(
                     v.requires_grad) if isinstance(v, torch.Tensor) else v
                 for v in vals]

    def run(*args: object) -> object:
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                             cache_enabled=cache_enabled):
            return Interpreter(sub).run(*args)

    with mode, fx_traceback.preserve_node_meta():
        return make_fx(run, tracing_mode="real")(*fakes)


def _meta_value(arg: object, gm: GraphModule) -> object:
    """What a subgraph operand holds, for tracing: the example value export recorded, or the
    module's own tensor behind a ``get_attr``."""
    if not isinstance(arg, Node):
        return arg
    if arg.op == "get_attr":
        return fetch_attr(gm, str(arg.target))
    if "val" not in arg.meta:
        raise ValueError(f"inline_autocast: operand {arg.name} has no example value (meta['val'])")
    return arg.meta["val"]
