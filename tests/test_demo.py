"""The demo decoder end to end on CPU: bit-exact streams, stable addresses, hoisting, verify mode."""

from __future__ import annotations

import math

import dataclasses

import pytest
import torch

import cadence_fx as cf
from cadence_fx.annotations import WORKSPACE_PREFIX
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog
from cadence_fx.analysis.ops import overload_name
from tests.helpers import live_view, run_streams, sha256

REGION_OUT = {1: 1, 2: 2, 3: 3}  # input index -> output index of each state region


def _same(refs, opts, cfg):
    """Every output equal; the estimator cache on its live slots (the stock one carries dead slots)."""
    live = {2: {0: cfg.steps}}
    for k, (r, o) in enumerate(zip(refs, opts)):
        for j, (a, b) in enumerate(zip(live_view(r, live), o)):
            assert a.shape == b.shape and torch.equal(a, b), f"call {k} output {j} differs"
    assert sha256([t for r in refs for t in live_view(r, live)]) == sha256([t for o in opts for t in o])


_CATALOGS: dict = {}


def _setup(cfg: DemoConfig, **kw):
    """The demo decoder (seed 0), its contract and its catalog, exported once per configuration for the
    module: the export is most of a test's time, and the tests only read what it returns (each one
    optimizes and streams its own program)."""
    key = (cfg, tuple(sorted(kw.items())))
    if key not in _CATALOGS:
        torch.manual_seed(0)
        model = StreamingDecoder(cfg).eval()
        contract = demo_contract(cfg, **kw)
        _CATALOGS[key] = model, contract, export_catalog(model, contract)
    return _CATALOGS[key]


def _inputs(cfg: DemoConfig, seed: int = 7):
    def make(k, state):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        tok = torch.randn(1, cfg.chunk, cfg.dim, generator=g)
        noise = torch.randn(1, cfg.chunk, cfg.dim, generator=g)
        return (tok, state[0], state[1], state[2], noise)
    return make


@pytest.mark.parametrize("verify", [False, True])
def test_stream_bit_exact_and_addresses_stable(verify):
    cfg = DemoConfig()
    model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract, verify=verify)
    refs, opts, ptrs = run_streams(eps, prog, _inputs(cfg), list(model.initial_state()), REGION_OUT, 10)
    _same(refs, opts, cfg)
    assert opts[0][2].shape[0] == cfg.steps < refs[0][2].shape[0]  # dead step slots are not state
    # the first call adopts the prompt state (a foreign tensor); every later call feeds back in place
    assert all(p == ptrs[0] for p in ptrs), "a region moved"
    assert ptrs[0] == [prog.region_pointer(n) for n in ("encoder_kv", "estimator_kv", "conv")]
    assert prog.stats["state_adopted"] == 3 and prog.stats["state_in_place"] == 3 * 9
    # at least two retention events happened in the stream
    extents = [o[1].shape[1] for o in opts]
    assert extents.count(cfg.head + cfg.tail) >= 2
    if verify:
        assert prog.auditor.checks >= 10 * 3


def test_carry_append_and_compaction_happen_in_place():
    cfg = DemoConfig()
    _model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract)
    # each class: the encoder's cat([cache, new]) and the conv's cat([ctx, x], -1) (in the envelope layout)
    assert prog.stats["passes"]["carry_writeback"] == 2 * len(eps)
    for gm in prog.graph_modules():
        code = "\n".join(sub.code for sub in gm.modules() if hasattr(sub, "code")).replace(" ", "")
        # no cat of the encoder cache or the conv context remains: history is never copied, only new frames
        assert "cat.default([enc_kv" not in code and "cat.default([conv" not in code


def test_restore_from_snapshot_mid_stream_is_bit_exact():
    cfg = DemoConfig()
    model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract)
    refs, opts, ptrs = run_streams(eps, prog, _inputs(cfg, 3), list(model.initial_state()), REGION_OUT, 9,
                                   restore_at=5)
    _same(refs, opts, cfg)
    assert all(p == ptrs[0] for p in ptrs)
    assert prog.stats["state_adopted"] == 6  # prompt + snapshot, three regions each


def test_hoisting_removes_host_table_and_keeps_bits():
    # float64 on the host then a conversion: the per-call copy changes something visible on CPU
    cfg = DemoConfig(freq_dtype=torch.float64)
    model, contract, eps = _setup(cfg)
    before = sum(1 for ep in eps for n in ep.graph.nodes if overload_name(n) in ("arange", "_to_copy", "to"))
    assert before > 0
    prog = cf.optimize(eps, contract)
    assert prog.stats["passes"]["hoist_constants"] > 0
    for gm in prog.graph_modules():
        for sub in gm.modules():
            if hasattr(sub, "graph"):
                assert not [n for n in sub.graph.nodes if overload_name(n) == "arange"]
    refs, opts, _ = run_streams(eps, prog, _inputs(cfg), list(model.initial_state()), REGION_OUT, 5)
    _same(refs, opts, cfg)


def test_verify_mode_names_region_and_call_on_a_broken_retention(monkeypatch):
    import cadence_fx.passes.retention_in_place as rip

    real = rip.retained_parts

    def broken(value, site, growth):
        parts = real(value, site, growth)
        for p in parts[1:]:
            p.src_offset = p.dst_offset  # pretend the tail is already in place: the stale-tail bug
        return parts

    monkeypatch.setattr(rip, "retained_parts", broken)
    cfg = DemoConfig()
    model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract, verify=True)
    with pytest.raises(cf.RetentionMismatch, match=r"region 'encoder_kv', call 2, retention: first differing"):
        run_streams(eps, prog, _inputs(cfg), list(model.initial_state()), REGION_OUT, 6)


def test_unwrapped_program_is_also_exact():
    cfg = DemoConfig(est_order="new_old", enc_order="old_new")
    model, contract, eps = _setup(cfg, wrap=())
    prog = cf.optimize(eps, contract)
    assert "partition" not in prog.stats["passes"]
    refs, opts, _ = run_streams(eps, prog, _inputs(cfg), list(model.initial_state()), REGION_OUT, 6)
    _same(refs, opts, cfg)


def test_plan_reports_catalog_and_over_reservation():
    cfg = DemoConfig()
    _model, contract, eps = _setup(cfg)
    p = cf.plan(eps, contract)
    est = p.region("estimator_kv")
    assert list(est.extents) == [8, 12, 14]
    assert est.attended == 14 and est.envelope == 18
    assert est.static_shape == (cfg.slots, cfg.capacity, 2 * cfg.dim)
    assert est.demand_shape == (cfg.steps, 18, 2 * cfg.dim)
    assert est.over_reservation == pytest.approx((5 * 64) / (3 * 18))
    assert [c["encoder_kv"] for c in p.classes] == [8, 12, 14]
    text = str(p)
    assert "over-reserved" in text and "class 2: encoder_kv=14" in text


def test_catalog_miss_is_a_clear_error():
    cfg = DemoConfig()
    model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract)
    enc, est, conv = model.initial_state()
    bad = torch.zeros(1, 9, 2 * cfg.dim)
    with pytest.raises(cf.CatalogMiss, match="no exported program covers"):
        prog(torch.zeros(1, cfg.chunk, cfg.dim), bad, est, conv, torch.zeros(1, cfg.chunk, cfg.dim))


def test_cli_plan_prints_catalog(capsys):
    from cadence_fx.cli import main

    assert main(["plan", "demo"]) == 0
    out = capsys.readouterr().out
    assert "catalog: 3 signature class(es)" in out and "estimator_kv extents: [8, 12, 14]" in out


@pytest.mark.parametrize("target, says", [
    ("nosuch_module:make", "cannot import 'nosuch_module'"),
    ("cadence_fx.contract:no_such_function", "has no function 'no_such_function'"),
    ("demo2", "TARGET must be 'demo', 'token2wav' or 'module:function'"),
    ("cadence_fx.contract:Clock", "missing"),  # a callable that fails: its own error, not the CLI's
])
def test_cli_errors_are_usage_messages(capsys, target, says):
    from cadence_fx.cli import main

    if says == "missing":
        with pytest.raises(TypeError, match="missing"):
            main(["plan", target])
        return
    with pytest.raises(SystemExit) as e:
        main(["plan", target])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_solver_history_workspace_is_the_region_buffer():
    """The demo solver writes each step's history + new frames into a workspace of its own (slots=5,
    capacity=64), then trims it into the state: the workspace becomes the region buffer, in the
    envelope layout (the 3 live step slots x the longest in-flight extent, 14 + 4), in every class."""
    cfg = DemoConfig()
    _model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract)
    workspaces = [name for gm in prog.graph_modules() for name, _b in gm.named_buffers()
                  if name.rpartition(".")[2].startswith(WORKSPACE_PREFIX)]
    assert prog.stats["passes"]["envelope_state"] == len(eps) and not workspaces, workspaces
    rp = next(r for r in prog.plan.regions if r.name == "estimator_kv")
    assert rp.layout == "envelope" and rp.stored_shape[rp.axis] == cfg.head + cfg.tail + cfg.chunk
    assert prog.region_buffers["estimator_kv"].numel() == math.prod(rp.stored_shape)


def test_no_grad_block_is_inlined_and_its_host_constant_hoisted():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():  # like HiFT's sine generator
                harmonics = torch.arange(1, 5, dtype=torch.float64).to(x.dtype)
                y = x * harmonics
            return self.lin(y)

    x = torch.randn(2, 4)
    ep = torch.export.export(M(), (x,))
    assert [n for n in ep.graph.nodes if "set_grad" in str(n.target)], "export no longer wraps no_grad blocks"
    prog = cf.optimize(ep, cf.Contract(clocks=(cf.Clock("frame", 1),)))
    code = prog.graph_modules()[0].code
    assert "arange" not in code and "wrap_with_set_grad_enabled" not in code
    assert prog.stats["passes"]["inline_grad_regions"] == 1 and prog.stats["passes"]["hoist_constants"] == 1
    with torch.no_grad():
        assert torch.equal(prog(x), ep.module()(x))


def test_admission_predicate_keeps_refused_classes_eager():
    from cadence_fx.testing.fake_backend import FakeBackend

    cfg = DemoConfig()
    model, contract, eps = _setup(cfg)
    # refuse the pinned class (history at head + tail): it runs eagerly, counted; the others replay
    contract = dataclasses.replace(contract, admit=lambda c: c["frame"] <= cfg.chunk and c["encoder_kv"] < 14)
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    state0 = list(model.initial_state())
    prog.warmup(torch.zeros(1, cfg.chunk, cfg.dim), *state0, torch.zeros(1, cfg.chunk, cfg.dim))
    before = prog.counters()
    refs, opts, _ = run_streams(eps, prog, _inputs(cfg), state0, REGION_OUT, 6)
    _same(refs, opts, cfg)
    after = prog.counters()
    assert prog.stats["not_admitted"] == 4  # calls 3..6 are in the refused class
    assert after["replays"] - before["replays"] == 2 * 2  # two admitted calls x (encoder, solver)
    assert after["eager"] == before["eager"] == 0  # refused calls never reach an engine


def test_saved_and_loaded_catalog_shares_one_copy_of_the_weights(tmp_path):
    """A catalog saved and loaded program by program comes back with one weight copy per program;
    optimize folds the copies into one and the stream stays bit-exact."""
    cfg = DemoConfig()
    model, contract, eps = _setup(cfg)
    for i, ep in enumerate(eps):
        torch.export.save(ep, tmp_path / f"class{i}.pt2")
    loaded = [torch.export.load(tmp_path / f"class{i}.pt2") for i in range(len(eps))]
    name = next(iter(loaded[0].state_dict))
    ptrs = {ep.state_dict[name].data_ptr() for ep in loaded}
    assert len(ptrs) == len(eps)  # one copy each, as loaded
    reference = [torch.export.load(tmp_path / f"class{i}.pt2") for i in range(len(eps))]
    prog = cf.optimize(loaded, contract)
    weights = sum(t.untyped_storage().nbytes() for t in loaded[0].state_dict.values())
    assert prog.shared_bytes >= (len(eps) - 1) * weights > 0
    assert len({ep.state_dict[name].data_ptr() for ep in loaded}) == 1
    for gm in prog.graph_modules()[1:]:  # every class program runs on the first program's tensors
        assert {p.data_ptr() for p in gm.parameters()} <= {p.data_ptr() for p in prog.graph_modules()[0].parameters()}
    refs, opts, _ = run_streams(reference, prog, _inputs(cfg), list(model.initial_state()), REGION_OUT, 8)
    _same(refs, opts, cfg)
    assert sha256([t for o in refs for t in live_view(o, {2: {0: cfg.steps}})]) == sha256([t for o in opts for t in o])


def test_optimize_keeps_one_workspace_copy_alive():
    """Catalog classes grow the shared workspace copy one after another; the outgrown copies are freed.
    (Without the state rule: with it, this workspace becomes the region buffer.)"""
    import gc

    cfg = DemoConfig()
    _model, contract, eps = _setup(cfg)
    prog = cf.optimize(eps, contract, state=False)
    (final,) = prog.workspaces()
    gc.collect()
    # a tensor with the copy's layout but fewer frames, still holding bytes, is an outgrown copy kept alive
    outgrown = [t for t in gc.get_objects() if type(t) is torch.Tensor and t.dim() == 3
                and (t.shape[0], t.shape[2]) == (cfg.steps, 2 * cfg.dim) and t.shape[1] < final.shape[1]
                and t.untyped_storage().nbytes() > 0
                and t.untyped_storage().data_ptr() != final.untyped_storage().data_ptr()]
    assert final.shape[1] == cfg.head + cfg.tail + cfg.chunk and not outgrown


def test_warmup_snapshots_no_region_or_workspace_per_capture(monkeypatch):
    """Warm-up keeps one host copy of the regions and workspaces for the whole warm-up; the captures
    inside it (the solver's writes into its history, which is the region buffer) do not snapshot them
    again, and the stream after warm-up is still bit-exact."""
    from cadence_fx.testing.fake_backend import FakeBackend

    cfg = DemoConfig()
    model, contract, eps = _setup(cfg, wrap=("encoder", "solver.estimator"))
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    state0 = list(model.initial_state())
    prog.warmup(torch.zeros(1, cfg.chunk, cfg.dim), *state0, torch.zeros(1, cfg.chunk, cfg.dim))
    owned = prog.owned_storages()
    reports = [r for eng in prog.runners().values() for r in eng.classes.values()]
    assert prog.counters()["captures"] > 0 and reports
    assert not [r.snapshotted & owned for r in reports if r.snapshotted & owned], \
        "a capture inside warm-up snapshotted a region or workspace"
    refs, opts, _ = run_streams(eps, prog, _inputs(cfg), state0, REGION_OUT, 6)
    _same(refs, opts, cfg)
    assert prog.counters()["eager"] == 0


def test_demo_script_as_the_readme_runs_it():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "examples" / "demo.py"), "--calls", "4", "--dim", "16"],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bit-identical     : True" in proc.stdout
    assert "each equal to its solo unmodified run: [True, True, True]" in proc.stdout
