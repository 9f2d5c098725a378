"""Lanes after the first are copies of its rewritten programs: the same graphs, shared weights and
constants, each lane's own region buffers, workspaces and written scratch; where a program cannot be
copied, the passes build the lane."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.fx import GraphModule

import cadence_fx as cf
from cadence_fx import build, pipeline
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from cadence_fx.runtime.clone import NotCopyable, copy_program
from tests.helpers import demo_catalog, sha256

CFG = DemoConfig()


@pytest.fixture(scope="module")
def setup():
    return demo_catalog(CFG)


def _count_pipeline_runs(monkeypatch) -> list[int]:
    runs: list[int] = []
    real = pipeline.run_pipeline
    monkeypatch.setattr(build, "run_pipeline", lambda *a, **k: runs.append(1) or real(*a, **k))
    return runs


def _tensors(gm: GraphModule) -> list[torch.Tensor]:
    out = []
    for mod in gm.modules():
        out += [t for t in mod._parameters.values() if t is not None]
        out += [t for t in mod._buffers.values() if t is not None]
        out += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
    return out


def _stream(prog, model, calls=4):
    """Four conversations, one call each in turn, on whatever lanes are free: every output's digest."""
    sessions = [prog.session(f"s{i}") for i in range(4)]
    states = [[s + 0.01 * i for s in model.initial_state()] for i in range(4)]
    outs = []
    for k in range(calls):
        for i, s in enumerate(sessions):
            g = torch.Generator().manual_seed(100 * i + k)
            o = s(torch.randn(1, CFG.chunk, CFG.dim, generator=g), *states[i],
                  torch.randn(1, CFG.chunk, CFG.dim, generator=g))
            outs += [t.clone() for t in o]
            states[i] = list(o[1:])
    return sha256(outs)


@pytest.mark.parametrize("state", [True, False], ids=["regions", "workspaces"])
def test_further_lanes_copy_the_first_lanes_programs_and_own_what_they_write(setup, monkeypatch, state):
    model, contract, eps = setup
    runs = _count_pipeline_runs(monkeypatch)
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3, state=state)
    assert len(runs) == len(eps)  # the passes ran for lane 0 only
    lanes = prog.lanes.lanes
    first = lanes[0]
    weights = {t.untyped_storage().data_ptr() for e in first.catalog.values() for t in _tensors(e.gm)
               if not first.writes(t)}
    for lane in lanes[1:]:
        assert [k for k in lane.catalog] == [k for k in first.catalog]
        for (_k, e0), (_k1, e) in zip(first.catalog.items(), lane.catalog.items()):
            assert e.gm is not e0.gm and e.gm.code == e0.gm.code
            assert {n: m.code for n, m in e.gm.named_modules() if isinstance(m, GraphModule)} == \
                {n: m.code for n, m in e0.gm.named_modules() if isinstance(m, GraphModule)}
            for t in _tensors(e.gm):
                ptr = t.untyped_storage().data_ptr()
                # shared: weights and constants; owned: this lane's alone, no other lane's
                assert ptr in weights or lane.writes(t), "a tensor that is neither shared nor the lane's own"
                assert not any(other.writes(t) for other in lanes if other is not lane)
        if not state:
            assert lane.state.workspaces() and all(
                torch.equal(w, w0) and w.data_ptr() != w0.data_ptr()
                for w, w0 in zip(lane.state.workspaces(), first.state.workspaces()))
    if state:  # sessions (which spread over the lanes) need the state rule
        # the same bytes as lanes the passes built, call for call
        monkeypatch.setattr(build.PassesSource, "copyable", False)
        rewritten = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3, state=state)
        assert len(runs) == 4 * len(eps)
        assert _stream(prog, model) == _stream(rewritten, model)


def test_copy_program_refuses_what_it_cannot_copy():
    owned = torch.zeros(8)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    gm.kept_view = owned[2:]  # a view of an owned buffer kept as an attribute: the copy would share it
    with pytest.raises(NotCopyable, match="'kept_view' views storage the lane owns"):
        copy_program(gm, {}, frozenset({owned.untyped_storage().data_ptr()}))
    # the owned tensor itself is rebound, and weights are shared
    gm2 = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    gm2.register_buffer("state", owned)
    mine = torch.ones(8)
    copied = copy_program(gm2, {id(owned): mine}, frozenset({owned.untyped_storage().data_ptr()}))
    assert copied.state is mine and copied.weight is gm2.weight
    # the code is shared, not generated again: the same graph, the same compiled class
    assert copied is not gm2 and copied.graph is gm2.graph and type(copied) is type(gm2)
    x = torch.randn(3, 2)
    assert torch.equal(copied(x), gm2(x))
    gm2.register_forward_hook(lambda *a: None)
    with pytest.raises(NotCopyable, match="_forward_hooks"):
        copy_program(gm2, {}, frozenset())
    gm3 = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    gm3.note = "text"
    with pytest.raises(NotCopyable, match="attribute 'note' of type str"):
        copy_program(gm3, {}, frozenset())


def test_a_lane_that_cannot_be_copied_is_built_by_the_passes(setup, monkeypatch, caplog):
    model, contract, eps = setup
    runs = _count_pipeline_runs(monkeypatch)

    def refuse(*_a, **_k):
        raise NotCopyable("module 'x' holds attribute 'y' of type str")

    monkeypatch.setattr(build, "copy_lane", refuse)
    with caplog.at_level(logging.INFO, logger="cadence_fx"):
        prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2)
    assert len(runs) == 2 * len(eps)
    assert "lane 1: rewritten by the passes (lane 0's programs cannot be copied: module 'x'" in caplog.text
    monkeypatch.undo()
    assert _stream(prog, model) == _stream(cf.optimize(eps, contract, replay=FakeBackend(), lanes=2), model)


class _CountingBackend(FakeBackend):
    """Counts every run of a partition on the "capture stream" (probe, warm-up and the capture's own
    run) and can fail chosen captures, as a capture that breaks on a GPU would."""

    def __init__(self, fail_at: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.attempts = 0

    def capture(self, fn, static_args, pool):
        self.attempts += 1
        if self.attempts in self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(fn, static_args, pool)


def _warm(prog, model):
    x = torch.zeros(1, CFG.chunk, CFG.dim)
    return prog.warmup(x, *model.initial_state(), x)


def test_lanes_after_the_first_capture_without_probing_again(setup):
    """A class one lane probed is captured on the others from its verdict: no probe, one eager run per
    partition on the lane's capture stream (its first), then captures only; the same bytes."""
    model, contract, eps = setup
    one = cf.optimize(eps, contract, replay=FakeBackend(), lanes=1)
    _warm(one, model)
    three = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3)
    _warm(three, model)
    engines = three.runners()
    assert engines and any(k.startswith("lane2/") for k in engines)
    for name, eng in engines.items():
        assert eng.classes, name
        for report in eng.classes.values():
            assert report.admitted
            if name.startswith("lane"):  # lanes 1 and 2: the verdict of lane 0's probe
                assert report.phase_seconds["probe"] == 0.0, name
            else:
                assert report.phase_seconds["probe"] > 0.0, name
    assert three.counters()["captures"] == 3 * one.counters()["captures"]
    assert _stream(three, model) == _stream(one, model)
    # every call of the stream replayed: nothing fell back on a lane captured from a verdict
    assert three.counters()["eager"] == 0 and three.counters()["replays"] > 0


def test_a_capture_from_a_verdict_that_fails_is_probed_and_captured_the_full_way(setup):
    model, contract, eps = setup
    one = cf.optimize(eps, contract, replay=_CountingBackend(), lanes=1)
    _warm(one, model)
    first_lane = one.counters()["captures"]
    backend = _CountingBackend(fail_at=frozenset({first_lane + 1}))  # lane 1's first capture breaks
    two = cf.optimize(eps, contract, replay=backend, lanes=2)
    _warm(two, model)
    assert backend.attempts == 2 * first_lane + 1
    assert two.counters()["captures"] == 2 * first_lane
    lane1 = [e for k, e in two.runners().items() if k.startswith("lane1/")]
    probed = [r for e in lane1 for r in e.classes.values() if r.phase_seconds["probe"] > 0.0]
    assert len(probed) == 1 and all(r.admitted for e in lane1 for r in e.classes.values())
    assert _stream(two, model) == _stream(one, model)


class _Draws(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


class _Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.part = torch.fx.symbolic_trace(_Draws())  # a partition: a graph module of its own
        self.register_buffer("scratch", torch.zeros(3))

    def forward(self, x):
        torch.ops.aten.copy_.default(self.scratch, x)  # an in-place write as torch.export records it
        return self.part(x) + torch.randn_like(x)


def _marked_root():
    from cadence_fx.annotations import RANDOM

    class Tracer(torch.fx.Tracer):  # the drawing part stays a call_module, as a partition does
        def is_leaf_module(self, m, name):
            return name == "part" or super().is_leaf_module(m, name)

    root = _Root()
    gm = GraphModule(root, Tracer().trace(root))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.randn_like:
            n.target = torch.ops.aten.randn_like.default  # as torch.export records it
        if n.op == "call_module" or n.target is torch.ops.aten.randn_like.default:
            n.meta[RANDOM] = True
    gm.recompile()
    return gm


def test_routing_draws_regenerates_code_only_for_a_retargeted_call():
    """A partition that draws is wrapped by attribute (the code is unchanged: no code generation, as
    in every lane copy); a root-level draw is retargeted through ``draw_random`` (the code changes)."""
    from cadence_fx.runtime.runners import RandomGuard, draw_random, isolate_randomness

    gm = _marked_root()
    code = gm.code
    assert isolate_randomness(gm) == 2
    assert isinstance(gm.part, RandomGuard) and "draw_random" in gm.code and gm.code != code
    # a copy of the routed program (lane 0's graph, draws already retargeted): wrapping only
    copy = copy_program(gm, {}, frozenset())
    assert not isinstance(copy.part, RandomGuard) and copy.graph is gm.graph  # unwrapped, shared graph
    calls = []
    orig = type(copy).recompile
    type(copy).recompile = lambda self: calls.append(1) or orig(self)
    try:
        assert isolate_randomness(copy) == 2
    finally:
        type(copy).recompile = orig
    assert calls == [] and isinstance(copy.part, RandomGuard) and copy.code is gm.code
    assert sum(n.target is draw_random for n in copy.graph.nodes) == 1


def test_a_programs_writes_are_walked_once_per_graph(monkeypatch):
    """``lane_writes``: a lane copy (the same graph) reuses the first lane's walk, taken on the graph
    before draws were routed; another graph is walked on its own."""
    from cadence_fx.runtime import lanes

    walks = []
    real = lanes.attribute_writes
    monkeypatch.setattr(lanes, "attribute_writes", lambda mod: walks.append(mod) or real(mod))
    gm = _marked_root()
    first = lanes.lane_writes(gm)
    assert first == {"scratch": False}  # written before it is read: scratch, not carried state
    copy = copy_program(gm, {}, frozenset())
    assert lanes.lane_writes(copy) == first and len(walks) == 1
    lanes.lane_writes(copy)["extra"] = True  # the caller's dict: the memo is not changed through it
    assert lanes.lane_writes(gm) == first
    assert lanes.lane_writes(_marked_root()) == first and len(walks) == 2


def test_a_copied_module_has_the_tables_a_built_one_has_and_none_shared():
    """Copies skip ``nn.Module.__init__``: each copy must still hold every field a module built by it
    holds, with tables of its own (a table shared between two lanes' modules would let one lane's
    registration reach the other's)."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    gm.register_buffer("scratch", torch.zeros(3), persistent=False)
    gm.add_module("box", torch.nn.Module())  # a plain container holding a graph module
    gm.box.add_module("inner", torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
    a, b = copy_program(gm, {}, frozenset()), copy_program(gm, {}, frozenset())
    built = vars(torch.nn.Module())
    for mod_a, mod_b, src in zip(a.modules(), b.modules(), gm.modules()):
        assert set(built) <= set(vars(mod_a))
        for name, value in built.items():
            if isinstance(value, (dict, set, list)):
                assert vars(mod_a)[name] is not vars(mod_b)[name] and vars(mod_a)[name] is not vars(src)[name]
        assert dict(mod_a.named_parameters(recurse=False)).keys() == dict(src.named_parameters(recurse=False)).keys()
    assert a._non_persistent_buffers_set == {"scratch"} and "scratch" not in a.state_dict()
    a.register_buffer("only_a", torch.ones(1))
    assert not hasattr(b, "only_a") and "only_a" not in gm._buffers
    x = torch.randn(4, 2)
    assert torch.equal(a(x), gm(x)) and torch.equal(b(x), gm(x))
