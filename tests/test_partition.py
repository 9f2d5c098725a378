"""Partitioning and lowering on CPU (FakeBackend): capture breakers inside a wrapped callable, and
the write analysis that decides what a capture has to snapshot."""

from __future__ import annotations

import copy

import pytest
import torch

import cadence_fx as cf
from cadence_fx.analysis.ops import is_guard
from cadence_fx.annotations import SEGMENT, WRAPPED
from cadence_fx.passes.mark_replay import written_arguments
from cadence_fx.passes.partition import breaks_capture
from cadence_fx.testing.fake_backend import FakeBackend

N_FFT, HOP = 16, 4


class Vocoder(torch.nn.Module):
    """Convolutions, then an inverse STFT (its NOLA check reads the device on the host), then more work."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Conv1d(4, 2 * (N_FFT // 2 + 1), 3, padding=1)
        self.register_buffer("window", torch.hann_window(N_FFT))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        spec = self.pre(mel)
        mag, phase = spec.chunk(2, dim=1)
        pcm = torch.istft(torch.polar(torch.exp(mag), phase), N_FFT, HOP, N_FFT, window=self.window)
        return torch.tanh(pcm * 0.5).clamp(-0.99, 0.99)


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vocoder = Vocoder()

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.vocoder(mel) * 2


def _wrapped_calls(prog: cf.OptimizedProgram) -> list[tuple[str, str]]:
    gm = prog.graph_modules()[0]
    # torch.export's input guard runs eagerly before every partition: not a segment
    return [(n.target, n.meta.get(WRAPPED)) for n in gm.graph.nodes
            if n.op == "call_module" and not is_guard(n)]


def test_istft_splits_a_wrapped_callable_into_two_replayed_segments():
    torch.manual_seed(0)
    step = Step().eval()
    mel = torch.randn(1, 4, 12)
    ep = torch.export.export(step, (mel,))
    assert any(breaks_capture(n) for n in ep.graph.nodes)
    contract = cf.Contract(clocks=(cf.Clock("frame", 12),), wrap=("vocoder",))
    backend = FakeBackend()
    prog = cf.optimize(ep, contract, replay=backend)
    calls = _wrapped_calls(prog)
    wrapped = [c for c in calls if c[1] is not None]
    assert len(wrapped) == 2 and len({w for _t, w in wrapped}) == 1, calls  # one callable, two segments
    assert [w is not None for _t, w in calls] == [True, False, True, False]  # istft eager in between; `* 2` after
    prog.warmup(mel)
    before = prog.counters()
    ref = ep.module()
    for k in range(4):
        x = torch.randn(1, 4, 12, generator=torch.Generator().manual_seed(k))
        with torch.no_grad():
            assert torch.equal(prog(x), ref(x))
    c = prog.counters()
    assert c["replays"] - before["replays"] == 2 * 4 and c["eager"] == 0 and backend.captures == 2


def test_write_analysis_names_exactly_the_written_arguments():
    class Part(torch.nn.Module):
        def forward(self, state, x, w):
            state.narrow(1, 2, 3).copy_(x @ w)  # a write through a view of argument 0
            return state.sum(1), w * 2

    ep = torch.export.export(Part(), (torch.zeros(4, 8), torch.randn(4, 2), torch.randn(2, 3)))
    assert written_arguments(ep.graph_module) == {0}  # a flat ATen graph, as a partition is
    gm = ep.graph_module
    gm.add_submodule("anything", torch.nn.Identity())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_module("anything", (next(iter(gm.graph.nodes)),))  # the schema cannot vouch for it
    assert written_arguments(gm) is None


def test_only_written_arguments_are_snapshotted_by_capture():
    from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

    cfg = DemoConfig()
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval()
    contract = demo_contract(cfg)
    prog = cf.optimize(export_catalog(model, contract), contract, replay=FakeBackend())
    engines = prog.runners()
    assert engines
    for eng in engines.values():
        assert eng.mutable is not None
        sub = eng.fn
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        # every written argument is a region or workspace: never a parameter or a constant
        for i in eng.mutable:
            assert i not in eng.readonly
            assert not phs[i].name.startswith(("p_", "c_")), phs[i].name


def _demo_split_at_estimator():
    """The demo decoder with its solver loop split at the estimator (one segment per step): its config,
    model, contract, exported catalog, and the per-call inputs of a seeded stream."""
    import dataclasses

    from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

    cfg = DemoConfig()
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval()
    contract = dataclasses.replace(demo_contract(cfg), split_at=("solver.estimator",))

    def inputs(k, state):
        g = torch.Generator().manual_seed(k)
        return (torch.randn(1, cfg.chunk, cfg.dim, generator=g), *state, torch.randn(1, cfg.chunk, cfg.dim, generator=g))

    return cfg, model, contract, export_catalog(model, contract), inputs


def test_split_at_cuts_a_wrapped_loop_into_one_graph_per_step():
    """Chunk clock with split_at the estimator: the solver loop is one wrapped callable in `steps`
    segments (each step plus the glue after it), every segment replays, the stream is bit-exact."""
    from tests.helpers import run_streams

    cfg, model, contract, eps, inputs = _demo_split_at_estimator()
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    for gm in prog.graph_modules():
        segments = [(n.meta[WRAPPED], n.meta[SEGMENT]) for n in gm.graph.nodes
                    if n.op == "call_module" and n.meta.get(WRAPPED)]
        solver = [s for w, s in segments if "solver" in w]
        assert solver == list(range(cfg.steps)), segments
        # the partitions were built lazily (code generated once per module, not per pass that edits
        # it) and the program handed back is complete: no first call, from any thread, builds code
        for m in gm.modules():
            if isinstance(m, torch.fx.GraphModule):
                assert type(m).forward is not getattr(type(m), "_lazy_forward", None), type(m)
    state0 = list(model.initial_state())
    prog.warmup(torch.zeros(1, cfg.chunk, cfg.dim), *state0, torch.zeros(1, cfg.chunk, cfg.dim))
    before = prog.counters()
    refs, opts, _ = run_streams(eps, prog, inputs, state0, {1: 1, 2: 2, 3: 3}, 6)
    for k, (r, o) in enumerate(zip(refs, opts)):
        for j, (a, b) in enumerate(zip(r, o)):
            a = a.narrow(0, 0, cfg.steps) if j == 2 else a  # the stock cache carries dead step slots
            assert torch.equal(a, b), (k, j)
    after = prog.counters()
    assert after["eager"] == before["eager"] and after["replays"] - before["replays"] == 6 * (1 + cfg.steps)
    assert any("#" in name for name in prog.runners())  # segments are named invocation#k


def test_split_at_names_a_missing_module_clearly():
    import dataclasses

    import pytest

    from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

    cfg = DemoConfig()
    model = StreamingDecoder(cfg).eval()
    contract = dataclasses.replace(demo_contract(cfg), split_at=("solver.estimater",))
    with pytest.raises(cf.ContractError, match=r"Contract.split_at: 'solver.estimater' matches no node"):
        cf.optimize(export_catalog(model, demo_contract(cfg)), contract)


class Counting(torch.nn.Module):
    """A weight the step only reads, and a buffer it writes in place every call (a call counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.lin(x) * self.calls


class CountingStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Counting()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + 1


def test_read_only_weights_become_the_partitions_own_not_per_call_inputs():
    """bind_constants: the weight and bias the wrapped partition only reads are its own attributes (the
    same tensors, no copy) and no longer inputs; the buffer it writes in place stays an input, so the
    replay engine still snapshots and restores it around a capture. Warm-up puts the counter back too
    (it runs the program once per class: before, the counter came out one call ahead and every later
    output differed). Results equal the exported program's, call after call, counter included."""
    torch.manual_seed(0)
    step = CountingStep().eval()
    x = torch.randn(2, 8)
    ep = torch.export.export(step, (x,))
    ref_mod = torch.export.export(copy.deepcopy(step), (x,)).module()  # a counter of its own
    contract = cf.Contract(clocks=(cf.Clock("frame", 2),), wrap=("block",))
    prog = cf.optimize(ep, contract, replay=FakeBackend())
    assert prog.stats["passes"]["bind_constants"] == 2
    gm = prog.graph_modules()[0]
    call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.meta.get(WRAPPED))
    sub = getattr(gm, call.target)
    inputs = [a.target for a in call.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    assert any("calls" in t for t in inputs) and not any("lin" in t for t in inputs), inputs
    own = dict(sub.named_parameters())
    assert {t.data_ptr() for t in own.values()} == {step.block.lin.weight.data_ptr(), step.block.lin.bias.data_ptr()}
    prog.warmup(x)  # a capture: the counter it advanced is put back
    for k in range(4):
        xk = torch.randn(2, 8)
        assert torch.equal(prog(xk), ref_mod(xk)), k


def test_a_counter_the_step_keeps_in_its_module_refuses_sessions():
    """A module buffer the step reads back in a later call (``calls.add_(1)``) is state the contract does
    not own: sessions would share one copy (each one's calls would change the others' bytes), so
    ``session()`` refuses, naming it; the program itself (one conversation) stays exact."""
    step = CountingStep().eval()
    x = torch.randn(2, 8)
    contract = cf.Contract(clocks=(cf.Clock("frame", 2),), wrap=("block",))
    prog = cf.optimize(torch.export.export(step, (x,)), contract, replay=FakeBackend())
    assert list(prog.undeclared_state()) == ["block.calls"]
    with pytest.raises(cf.ContractError, match=r"block\.calls.*Declare each as a Region"):
        prog.session()


class Scratch(torch.nn.Module):
    """A buffer the step writes before it reads it, every call: scratch, not state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tmp", torch.zeros(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tmp.copy_(x * 2)
        return self.tmp + 1


class ScratchStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Scratch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) - 1


def test_scratch_written_inside_a_partition_is_each_lanes_own():
    """A module buffer the wrapped partition writes (passed in by the outer graph) is scratch: sessions
    are allowed, and each lane gets its own copy, since two lanes replaying at once would otherwise
    write one tensor (before, only writes visible in the outer graph were privatized)."""
    step = ScratchStep().eval()
    x = torch.randn(2, 8)
    contract = cf.Contract(clocks=(cf.Clock("frame", 2),), wrap=("block",))
    prog = cf.optimize(torch.export.export(step, (x,)), contract, replay=FakeBackend(), lanes=2)
    assert prog.undeclared_state() == {}
    ptrs = []
    for lane in prog.lanes.lanes:
        gm = next(iter(lane.catalog.values())).gm
        ptrs.append(gm.block.tmp.data_ptr())
    assert ptrs[0] != ptrs[1]
    assert torch.equal(prog(x), step(x))


def test_a_lanes_engines_stage_into_one_shared_arena():
    """Without the state rule every argument of every replayed partition is staged. The engines of a
    lane replay one at a time, so they stage into one arena: the lane holds the largest class's
    staging rather than the sum over classes, and every call stays bit-exact."""
    from tests.helpers import run_streams

    cfg, model, contract, eps, inputs = _demo_split_at_estimator()
    prog = cf.optimize(eps, contract, replay=FakeBackend(), state=False)
    state0 = list(model.initial_state())
    prog.warmup(torch.zeros(1, cfg.chunk, cfg.dim), *state0, torch.zeros(1, cfg.chunk, cfg.dim))
    refs, opts, _ = run_streams(eps, prog, inputs, state0, {1: 1, 2: 2, 3: 3}, 6)
    for k, (r, o) in enumerate(zip(refs, opts)):
        for j, (a, b) in enumerate(zip(r, o)):
            assert torch.equal(a, b), (k, j)
    reports = [r for eng in prog.runners().values() for r in eng.classes.values()]
    staged = [r.staged_bytes for r in reports]
    allocated = sum(r.staging_bytes for r in reports)
    assert len(reports) > cfg.steps and prog.counters()["replays"] > 0
    assert allocated == prog.memory_census()["staging"]
    assert max(staged) <= allocated < sum(staged) / 2, (allocated, staged)


class _ScaledWindow(torch.nn.Module):
    """A window cache and a Python int argument (export bakes its value into the program)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, cache, scale: int):
        kv = torch.cat([cache, self.lin(x)], 1)
        return kv.sum(1) * scale, kv[:, -3:]


class _ReturnsConstants(torch.nn.Module):
    """Returns a host-built constant (hoisted into a buffer) and a weight as they are, beside a cache."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        kv = torch.cat([cache, self.lin(x)], 1)
        return kv.sum(1), kv[:, -3:], torch.arange(4), self.lin.bias


def _window_contract(wrap):
    return cf.Contract(clocks=(cf.Clock("frame", 1),), wrap=wrap, regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(3), initial=3),))


def test_a_python_int_argument_keys_the_catalog_by_value():
    torch.manual_seed(0)
    contract = _window_contract((cf.WHOLE_STEP,))
    eps = cf.export_catalog(_ScaledWindow().eval(), contract,
                            {"x": torch.zeros(1, 1, 4), "cache": torch.zeros(1, 3, 4), "scale": 3})
    prog, ref = cf.optimize(eps, contract, replay=FakeBackend()), cf.reference(eps)
    c = r = torch.randn(1, 3, 4)
    for _ in range(4):
        x = torch.randn(1, 1, 4)
        (y, c), (y_ref, r) = prog(x, c, 3), ref(x, r, 3)
        assert torch.equal(y, y_ref) and torch.equal(c, r)
    with pytest.raises(cf.CatalogMiss):
        prog(torch.randn(1, 1, 4), c, 4)  # another value is another program, which was not exported


@pytest.mark.parametrize("wrap", [(cf.WHOLE_STEP,), ("lin",)])
def test_outputs_that_are_module_tensors_survive_partitioning(wrap, tmp_path):
    torch.manual_seed(0)
    contract = _window_contract(wrap)
    eps = cf.export_catalog(_ReturnsConstants().eval(), contract, {"x": torch.zeros(1, 1, 4), "cache": torch.zeros(1, 3, 4)})
    prog, ref = cf.optimize(eps, contract, replay="off"), cf.reference(eps)
    cf.save(prog, tmp_path / "p.cfx")
    loaded = cf.load(tmp_path / "p.cfx")
    c = r = l = torch.randn(1, 3, 4)
    for _ in range(3):
        x = torch.randn(1, 1, 4)
        got, want, back = prog(x, c), ref(x, r), loaded(x, l)
        assert all(torch.equal(a, b) and torch.equal(a, d) for a, b, d in zip(got, want, back))
        c, r, l = got[1], want[1].clone(), back[1]
    assert cf.state_traffic(prog)[0]["regions"]["kv"]["optimized"] is not None  # the public figure


def test_a_partition_cut_between_a_regions_view_and_its_write_replays_exact(monkeypatch):
    """The journal's nodes made without the write's meta fall outside its wrapped invocation, so the
    partition cuts the invocation: one part returns the view of the region (bound as its attribute) that
    the next part writes in place, with an eager part between. Replayed after warm-up, the view must be
    handed on as the region's view (a clone would take the write), so the stream is exact and replays."""
    from cadence_fx.passes import journal_writes
    from cadence_fx.testing.demo_model import DemoConfig
    from tests.helpers import demo_catalog, demo_call, live_view, sha256

    monkeypatch.setattr(journal_writes, "adopt_meta", lambda first, write: None)
    cfg = DemoConfig()
    model, contract, eps = demo_catalog(cfg)
    prog = cf.optimize(eps, contract, replay=FakeBackend(), journal=True)
    # the cut: the encoder's invocation is two replayed parts in every class
    assert sum(name.endswith(":L__self__encoder") for name in prog.runners()) == 2 * len(eps)
    state0 = list(model.initial_state())
    prog.warmup(torch.zeros(1, cfg.chunk, cfg.dim), *state0, torch.zeros(1, cfg.chunk, cfg.dim))
    streams = []
    for fn in (cf.reference(eps), prog):
        state, outs = [s.clone() for s in state0], []
        torch.manual_seed(1)
        for k in range(6):
            o = demo_call(fn, cfg, 1, k, state)
            outs += [t.clone() for t in live_view(o, {2: {0: cfg.steps}})]
            state = list(o[1:])
        streams.append(sha256(outs))
    assert streams[0] == streams[1]
    c = prog.counters()
    assert c["eager"] == 0 and c["replays"] > 0 and not c["rejections"]
