"""Misuses that used to give silent wrong bytes: each is now an error, or exact."""

from __future__ import annotations

import pytest
import torch

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_catalog, live_view

CFG = DemoConfig()
LIVE = {2: {0: CFG.steps}}


@pytest.fixture(scope="module")
def setup():
    return demo_catalog(CFG)


def _fresh(k: int):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(1, CFG.chunk, CFG.dim, generator=g), torch.randn(1, CFG.chunk, CFG.dim, generator=g)


def _call(fn, k, state):
    tok, noise = _fresh(k)
    return fn(tok, *state, noise)


def _equal(ref, opt) -> bool:
    return all(torch.equal(a, b) for a, b in zip(live_view(ref, LIVE), opt))


@pytest.mark.parametrize("verify", [False, True])
def test_a_state_kept_from_an_older_call_is_refused(setup, verify):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, verify=verify, replay="off")
    state = list(model.initial_state())
    out1 = prog(*_fresh(0)[:1], *state, _fresh(0)[1])
    kept = list(out1[1:])  # a retry would feed these again after the next call
    out2 = _call(prog, 1, kept)
    _call(prog, 2, list(out2[1:]))  # the state the last call returned: in place, fine
    with pytest.raises(cf.StaleState, match=r"region 'encoder_kv': input 'enc_kv' is a view of a region buffer "
                                            r"but not the state the last call returned.*clone it"):
        _call(prog, 3, kept)


def test_a_retry_from_a_cloned_state_is_exact(setup):
    model, contract, eps = setup
    ref = cf.reference(eps)
    prog = cf.optimize(eps, contract, replay="off")
    state = list(model.initial_state())
    out = _call(prog, 0, state)
    kept = [t.clone() for t in out[1:]]  # what the error tells the caller to do
    _call(prog, 1, list(out[1:]))
    r_state = [t.clone() for t in _call(ref, 0, [s.clone() for s in state])[1:]]
    retry, expect = _call(prog, 1, kept), _call(ref, 1, r_state)
    assert _equal(expect, retry)


def test_foreign_state_that_requires_grad_does_not_poison_the_program(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    ref = cf.reference(eps)
    state = list(model.initial_state())
    graded = [s.clone().requires_grad_() for s in state]  # what ep.module() in grad mode hands back
    out = _call(prog, 0, graded)
    assert not any(b.requires_grad for b in prog.region_buffers.values())
    [t.clone() for t in out]  # used to raise "A view was created in no_grad mode ... modified inplace"
    # a fresh stream afterwards is still exact
    r_state, o_state = [s.clone() for s in state], list(state)
    for k in range(4):
        r, o = _call(ref, k, r_state), _call(prog, k, o_state)
        assert _equal(r, o), f"call {k}"
        r_state, o_state = [t.clone() for t in r[1:]], list(o[1:])


def test_weight_edits_caught_per_call_and_by_verify_weights():
    """In-place edits of a folded weight raise on the next call; an edit through ``.data`` bypasses the
    version counter the per-call guard reads (the documented limit) and ``verify_weights`` catches it."""
    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = torch.nn.Parameter(torch.rand(4) + 0.5)

        def forward(self, x):
            return x * (1.0 / (self.alpha + 1e-9))  # Snake's 1/alpha: folded once

    for edit, per_call in [(lambda p: p.mul_(2), True), (lambda p: p.data.mul_(2), False)]:
        step = Step()
        x = torch.randn(2, 4)
        prog = cf.optimize(torch.export.export(step, (x,)), cf.Contract(clocks=(cf.Clock("frame", 1),)))
        assert prog.stats["passes"]["fold_weights"] > 0
        prog.verify_weights()
        with torch.no_grad():
            edit(step.alpha)
        if per_call:
            with pytest.raises(cf.WeightsChanged, match="changed in place"):
                prog(x)
        else:
            prog(x)  # stale, and not seen per call: the limit
        with pytest.raises(cf.WeightsChanged, match=r"differs from its bytes .* \.data"):
            prog.verify_weights()


def test_counters_exclude_warmup_replays(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    state = list(model.initial_state())
    prog.warmup(_fresh(0)[0], *state, _fresh(0)[1])
    c = prog.counters()
    assert c["captures"] > 0 and c["replays"] == 0 and c["eager"] == 0 and not c["rejections"]
    assert prog.stats["calls"] == 0
    out = _call(prog, 0, state)
    _call(prog, 1, list(out[1:]))
    assert prog.counters()["replays"] == 2 * 2  # two calls x (encoder, solver)


def test_whole_step_wrap_with_an_inline_solver_loop_is_one_exact_partition():
    class Inline(torch.nn.Module):
        """A solver loop written inline in forward (no module path to wrap), a sliding-window cache."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8) / 4)

        def forward(self, x, cache):
            kv = torch.cat([cache, x], 1)
            for s in range(3):
                t = torch.tensor(s / 3.0)  # torch.tensor(x): lift_fresh_copy + detach_ in the graph
                x = x + torch.tanh((x @ self.w) * t + kv.mean(1, keepdim=True))
            return x, kv[:, -6:]

    contract = cf.Contract(clocks=(cf.Clock("frame", 2),), wrap=(cf.WHOLE_STEP,),
                           regions=(cf.Region("kv", input="cache", output=1, clock="frame", axis=1,
                                              order="old_new", retention=cf.SlidingWindow(6), initial=6),))
    step = Inline()
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(1, 2, 8), "cache": torch.zeros(1, 6, 8)})
    backend = FakeBackend()
    prog = cf.optimize(eps, contract, replay=backend)
    specs = [n.meta[cf.annotations.REPLAY] for gm in prog.graph_modules() for n in gm.graph.nodes
             if n.meta.get(cf.annotations.REPLAY) is not None]
    assert len(specs) == 1 and specs[0].written is not None  # export's guard stays outside: writes known
    ops = {str(n.target) for gm in prog.graph_modules() for m in gm.modules() if hasattr(m, "graph")
           for n in m.graph.nodes}
    assert not {"aten.lift_fresh_copy.default", "aten.detach_.default"} & ops  # the cone was hoisted through them
    prog.warmup(torch.zeros(1, 2, 8))
    ref = cf.reference(eps)
    g = torch.Generator().manual_seed(3)
    r_c, o_c = torch.randn(1, 6, 8, generator=g), None
    o_c = r_c.clone()
    for k in range(5):
        x = torch.randn(1, 2, 8, generator=g)
        r, o = ref(x, r_c), prog(x, o_c)
        assert torch.equal(r[0], o[0]) and torch.equal(r[1], o[1]), f"call {k}"
        r_c, o_c = r[1].clone(), o[1]
    assert prog.counters()["replays"] == 5 and prog.counters()["eager"] == 0


def test_quick_start_as_written_in_the_readme():
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    block = re.search(r"```python\n(# quick start.*?)```", readme, re.S)
    assert block, "the README has no quick start block"
    namespace: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    assert namespace["same"] is True


def test_a_tensor_built_fresh_and_written_in_place_each_call_is_not_hoisted():
    """A counter the step creates (``zeros``) and then increments in place every call (Moshi's per-frame
    ring offset) is no constant: hoisted, the increment would land in one shared buffer and the
    second call would start from the first call's value."""

    class Counter(torch.nn.Module):
        def forward(self, x):
            c = torch.zeros(1, dtype=torch.long)
            c.add_(1)
            return x + c

    ep = torch.export.export(Counter(), (torch.zeros(1, dtype=torch.long),))
    prog = cf.optimize([ep], cf.Contract(clocks=(cf.Clock("f", 1),)), replay="off")
    x = torch.zeros(1, dtype=torch.long)
    for _ in range(3):
        assert torch.equal(prog(x), ep.module()(x))


def test_a_bool_region_is_planned():
    """A one-element bool flag carried as state (a conv's "first frame" flag) is a region like any other."""

    class Flag(torch.nn.Module):
        def forward(self, x, first):
            return x * first, torch.zeros_like(first)

    ep = torch.export.export(Flag(), (torch.randn(1), torch.ones(1, dtype=torch.bool)))
    contract = cf.Contract(clocks=(cf.Clock("f", 1),), regions=(cf.Region(
        "first", input="first", output=1, clock="f", axis=0, order=None, retention=cf.Ring(1), initial=1),))
    prog = cf.optimize([ep], contract, replay="off")
    assert cf.plan([ep], contract).regions[0].stored_bytes == 1
    x, first = torch.randn(1), torch.ones(1, dtype=torch.bool)
    for _ in range(3):
        out, nxt = prog(x, first)
        ref, ref_next = ep.module()(x, first)
        assert torch.equal(out, ref) and torch.equal(nxt, ref_next)
        first = nxt
