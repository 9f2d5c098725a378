"""Constant hoisting: constant cones become buffers computed once, by the stock program's own kernels.

A cone is constant when nothing in it depends on the step's inputs: it starts at factory ops and at
parameters, buffers and constants the graph never writes, and holds nothing random or mutating.
Two kinds are hoisted:

* host-built cones (always, unless ``contract.hoist_constants`` is off): factories and dtype/device
  copies the step rebuilds on the host every call (``arange``, ``linspace``, ``tensor(...).to(dev)``),
  and everything computed from them. In Token2Wav the solver's schedule is a ``linspace`` inside the
  step, so this cone holds the DiT's timestep embedding and every block's adaLN modulation at every
  solver step;
* weight-derived cones (``contract.fold_weights``): values computed from the weights alone. In
  Token2Wav: HiFT's weight norm and Snake's ``1 / (alpha + eps)``, recomputed by the stock step on
  every call.

Each cone is evaluated once, op by op, on the program's own tensors and device: the same ATen ops
on the same inputs as the stock call, so the same bits. The weights a cone reads are read
once; a :class:`FoldedWeights` guard makes a later in-place change of one an error, not a stale value.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from cadence_fx.annotations import CONST_PREFIX
from cadence_fx.determinism import bits_equal, sha256_tensors
from cadence_fx.analysis.aliases import view_root
from cadence_fx.analysis.graph_io import fetch_attr, register_tensor
from cadence_fx.analysis.ops import is_mutating, is_random, is_view, overload_name
from cadence_fx.passes import PassContext
from cadence_fx.runtime.weights import FoldedWeights

# Factory ops whose result is fully determined by their arguments. ``empty*`` is left out:
# its contents are whatever the allocator hands back, so computing it "once" is not exact.
_FACTORIES = {"arange", "zeros", "ones", "full", "scalar_tensor", "linspace", "logspace", "eye",
              "zeros_like", "ones_like", "full_like", "lift_fresh_copy", "tensor"}
# A copy that changes device or dtype: the per-call host-to-device transfer we are removing.
_COPIES = {"_to_copy", "to", "_assert_tensor_metadata"}
_UNDEFINED = {"empty", "empty_like", "empty_strided"}
# In-place ops that change no value of a program run without autograd: ``torch.tensor(x)`` exports as
# ``lift_fresh_copy`` + ``detach_``, and the cone must go on through it.
_INERT_IN_PLACE = {"detach_"}


def hoist_constants(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace each constant cone (host-built, and weight-derived under ``fold_weights``) by one buffer."""
    contract = ctx.contract
    if not contract.hoist_constants:
        return gm
    graph = gm.graph
    # what the step writes in place is not constant: a weight it updates, and as much a tensor it builds
    # fresh every call and then writes (a counter zeroed then incremented): hoisted, the write would
    # land in the one shared buffer and the next call would start from the last call's value
    mutated = {view_root(n.args[0]) for n in graph.nodes if is_mutating(n) and overload_name(n) not in _INERT_IN_PLACE
               and n.args and isinstance(n.args[0], Node)}
    const: set[Node] = set()
    host_built: set[Node] = set()
    computes: set[Node] = set()  # const nodes whose cone runs at least one kernel (not only views of weights)
    for n in graph.nodes:
        if view_root(n) in mutated:
            continue
        if n.op == "get_attr":
            const.add(n)
            continue
        name = overload_name(n)
        if n.op != "call_function" or (is_mutating(n) and name not in _INERT_IN_PLACE) or is_random(n):
            continue
        inputs = n.all_input_nodes
        if all(i in const for i in inputs) and (inputs or name in _FACTORIES) and name not in _UNDEFINED:
            const.add(n)
            if name in _FACTORIES or name in _COPIES or any(i in host_built for i in inputs):
                host_built.add(n)
            if not is_view(n) or any(i in computes for i in inputs):
                computes.add(n)
    # host-built always (a ``to(device)`` of a weight is a view by schema, yet a copy every call)
    hoisted = host_built | computes if contract.fold_weights else host_built
    boundary = [n for n in graph.nodes if n in hoisted and n.op == "call_function"
                and any(u not in const for u in n.users) and isinstance(n.meta.get("val"), torch.Tensor)]
    env: dict[Node, object] = {}

    def evaluate(node: Node) -> object:
        if node in env:
            return env[node]
        if node.op == "get_attr":
            val = fetch_attr(gm, node.target)
        else:
            args = map_arg(node.args, evaluate)
            kwargs = map_arg(node.kwargs, evaluate)
            val = node.target(*args, **kwargs)
        env[node] = val
        return val

    # metadata assertions on constants are settled once here, not re-checked every call
    for n in list(graph.nodes):
        if overload_name(n) == "_assert_tensor_metadata" and n.args and n.args[0] in const:
            graph.erase_node(n)
    folded = 0
    with torch.no_grad():
        for n in boundary:
            value = _shared(ctx.tables.constants, evaluate(n))
            folded += n not in host_built
            attr = register_tensor(gm, CONST_PREFIX, value)
            with graph.inserting_before(n):
                ref = graph.get_attr(attr)
            ref.meta = dict(n.meta)
            n.replace_all_uses_with(ref)
    # every weight a hoisted cone read: guarded against later in-place edits
    weights = FoldedWeights()
    for n, val in env.items():
        if n.op == "get_attr" and isinstance(val, torch.Tensor):
            try:
                weights.sources.append((n.target, val, val._version))
                key = (val.data_ptr(), tuple(val.shape), val.stride(), val.dtype, val._version)
                if key not in ctx.tables.digests:  # every class of a catalog reads the same weights
                    ctx.tables.digests[key] = sha256_tensors(val)
                weights.digests[n.target] = ctx.tables.digests[key]
            except RuntimeError:  # an inference tensor has no version counter and cannot be edited outside one
                pass
    ctx.program.folded_weights = weights
    for n in reversed(list(graph.nodes)):  # DCE keeps in-place ops; an inert one on a hoisted value goes too
        if overload_name(n) in _INERT_IN_PLACE and not n.users and n.args and n.args[0] in const:
            graph.erase_node(n)
    graph.eliminate_dead_code()
    ctx.record("hoist_constants", len(boundary) - folded)
    ctx.record("fold_weights", folded)
    return gm


def _shared(table: dict[tuple, list[torch.Tensor]], value: torch.Tensor) -> torch.Tensor:
    """One buffer per distinct value across a catalog's programs (every class folds the same weights).

    Keyed by a digest of the bytes: Token2Wav hoists thousands of same-shaped constants (every
    block's adaLN chunks at every solver step), so comparing each with every other is quadratic.
    """
    key = (tuple(value.shape), value.stride(), value.dtype, value.device, sha256_tensors(value))
    for t in table.setdefault(key, []):
        if bits_equal(t, value):
            return t
    table[key].append(value)
    return value
