"""``drop_static_guards``: torch.export's input guard leaves a static program; the catalog still refuses
every call the guard would have refused, and the outputs stay bit-exact."""

from __future__ import annotations

import pytest
import torch

import cadence_fx as cf
from cadence_fx.contract import Contract
from cadence_fx.analysis.ops import is_guard
from cadence_fx.passes import PassConfig, PassContext, ProgramFacts
from cadence_fx.runtime.workspaces import CatalogTables
from cadence_fx.passes.drop_static_guards import drop_static_guards


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor):
        cache = torch.cat([cache, self.proj(x)], 1)[:, 1:]
        return cache.sum(1), cache


def _ctx() -> PassContext:
    return PassContext(PassConfig(Contract(clocks=(), regions=(), wrap=())), CatalogTables(), ProgramFacts({}, {}))


def _guards(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if is_guard(n)]


def test_a_static_program_loses_its_guard_and_a_symbolic_one_keeps_it():
    ep = torch.export.export(Step(), (torch.randn(2, 1, 4), torch.zeros(2, 3, 4)))
    gm = ep.module()
    assert _guards(gm), "torch.export no longer emits an input guard: this test checks nothing"
    ctx = _ctx()
    out = drop_static_guards(gm, ctx)
    assert not _guards(out)
    assert ctx.program.changed["drop_static_guards"] == 1

    batch = torch.export.Dim("batch", min=2, max=8)
    dyn = torch.export.export(Step(), (torch.randn(2, 1, 4), torch.zeros(2, 3, 4)),
                              dynamic_shapes=({0: batch}, {0: batch})).module()
    assert _guards(dyn)
    kept = drop_static_guards(dyn, _ctx())
    assert _guards(kept), "a symbolic size is the guard's to check"


def test_without_the_guard_the_catalog_still_refuses_what_the_guard_refused_and_bytes_are_exact():
    torch.manual_seed(0)
    step = Step().eval()
    x, cache = torch.randn(2, 1, 4), torch.zeros(2, 3, 4)
    ep = torch.export.export(step, (x, cache))
    contract = cf.Contract(clocks=(cf.Clock("frame", 1),), regions=(), wrap=(cf.WHOLE_STEP,))
    prog = cf.optimize([ep], contract, replay="off", state=False)
    assert all(not _guards(gm) for gm in prog.graph_modules())
    with pytest.raises(Exception, match="Guard failed"):
        ep.module()(torch.randn(3, 1, 4), torch.zeros(3, 3, 4))
    with pytest.raises(cf.CatalogMiss):
        prog(torch.randn(3, 1, 4), torch.zeros(3, 3, 4))
    ref = ep.module()
    c1 = c2 = cache
    for _ in range(4):
        x = torch.randn(2, 1, 4)
        with torch.no_grad():
            y1, c1 = ref(x, c1)
            y2, c2 = prog(x, c2)
        assert torch.equal(y1, y2) and torch.equal(c1, c2)
