"""The pass pipeline, in the one order it runs. Each entry is ``(GraphModule, PassContext) -> GraphModule``.

The pipeline ends at an annotated graph (:mod:`cadence_fx.annotations`); the runtime
(:mod:`cadence_fx.runtime`) installs the replay engines on it.
"""

from __future__ import annotations

from contextlib import nullcontext

from torch.fx import GraphModule

try:  # torch's own switch (private): without it every edit regenerates code, slower but the same program
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover - older or newer torch
    _LazyGraphModule, _use_lazy_graph_module = None, None

from cadence_fx.passes import PassContext
from cadence_fx.passes.bind_constants import bind_constants
from cadence_fx.passes.carry_writeback import carry_writeback
from cadence_fx.passes.cat_into_place import cat_into_place
from cadence_fx.passes.drop_empty_cat_operands import drop_empty_cat_operands
from cadence_fx.passes.drop_static_guards import drop_static_guards
from cadence_fx.passes.envelope_state import envelope_state
from cadence_fx.passes.hoist_constants import hoist_constants
from cadence_fx.passes.inline_autocast import inline_autocast
from cadence_fx.passes.inline_grad_regions import inline_grad_regions
from cadence_fx.passes.journal_writes import journal_writes
from cadence_fx.passes.mark_randomness import mark_randomness
from cadence_fx.passes.mark_replay import mark_replay
from cadence_fx.passes.partition import partition
from cadence_fx.passes.retention_in_place import retention_in_place
from cadence_fx.passes.ring_in_place import ring_in_place
from cadence_fx.passes.shrink_workspace import shrink_workspace

PIPELINE = (
    drop_static_guards,   # export's input guard of a static program -> gone (the catalog's exact dispatch implies it)
    inline_grad_regions,  # no_grad blocks inside the model -> plain code (the program never records grad)
    inline_autocast,      # autocast blocks -> the explicit casts autocast makes (the float16 switch)
    drop_empty_cat_operands,  # cat([torch.tensor([]), x]) -> cat([x]) (torch.cat skips it; the cache is first again)
    hoist_constants,      # host-built constants -> device buffers (before anything copies the graph)
    carry_writeback,      # bind regions to buffers; cat([cache, new]) -> in-place append
    ring_in_place,        # functional ring update (index_copy, scatter, ...) of a region -> in-place write of its buffer
    envelope_state,       # a non-leading history kept in a workspace of its own -> kept in the region buffer
    retention_in_place,   # outgoing state -> written into the same buffer; trim checked and compacted
    shrink_workspace,     # program-owned workspaces -> the box the step can reach (demand sizing)
    cat_into_place,       # copy_(dst, cat(fresh pieces)) -> cat(pieces, out=dst): one kernel, no temporary
    journal_writes,       # each write into a region's bytes -> preceded by a save of what it overwrites (the undo)
    partition,            # one sub-GraphModule per wrapped invocation
    bind_constants,       # weights a partition only reads -> its own attributes, not per-call inputs
    mark_replay,          # wrapped partitions -> annotated with what they alias, read and write
    mark_randomness,      # calls that draw from a generator -> annotated (per-session random streams)
)


def run_pipeline(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Run every pass in order; passes edit graphs, the code is generated once at the end.

    Modules made while the passes run (the partitions ``split_module`` builds, the ones passes add)
    are lazy: recompiling one only marks it, so a partition edited by several passes gets its Python
    code generated once, here, instead of once per edit. Generated here rather than at a module's
    first call, so the program handed back is complete and no first call (from any thread) builds code.
    """
    with _use_lazy_graph_module(True) if _use_lazy_graph_module else nullcontext():
        for p in PIPELINE:
            gm = p(gm, ctx)
            gm.graph.lint()
        gm.recompile()
    if _LazyGraphModule is not None:
        for m in gm.modules():
            _LazyGraphModule.force_recompile(m)  # type: ignore[arg-type]
    return gm
