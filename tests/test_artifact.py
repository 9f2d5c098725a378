"""``cf.save`` / ``cf.load``: an optimized catalog written once and loaded in a fresh process.

The loaded program must be the optimized program: the same bytes as the freshly optimized program
and as the unmodified exported programs on every output of a multi-chunk stream (replayed, after
warm-up), sessions and lanes included. An artifact that was altered, truncated, built for another
torch, device, kernel settings or contract must not load; a weight edited after loading is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_catalog, live_view, sha256

CFG = DemoConfig()
LIVE = {2: {0: CFG.steps}}  # the estimator cache's live step slots
CALLS = 8  # the demo's classes repeat from call 2 on: trims on calls 2..7
T2W_STREAM = 4  # Token2Wav: classes 16, 26, 36 frames of history, then the trim on calls 2 and 3
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    model, contract, eps = demo_catalog(CFG)
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    path = tmp_path_factory.mktemp("artifact") / "demo.cfx"
    info = cf.save(prog, path)
    return model, contract, eps, prog, path, info


def _inputs(seed: int, k: int):
    g = torch.Generator().manual_seed(seed * 1000 + k)
    return torch.randn(1, CFG.chunk, CFG.dim, generator=g), torch.randn(1, CFG.chunk, CFG.dim, generator=g)


def _stream(fn, state0, *, seed: int = 1, calls: int = CALLS):
    """Every call's outputs (state on its live extent), cloned; the state fed back as returned."""
    state, outs = [s.clone() for s in state0], []
    torch.manual_seed(seed)
    for k in range(calls):
        tok, noise = _inputs(seed, k)
        o = fn(tok, *state, noise)
        outs.append([t.clone() for t in live_view(o, LIVE)])
        state = list(o[1:])
    return outs


def _assert_same(a, b, what: str) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        for i, (s, t) in enumerate(zip(x, y)):
            assert s.shape == t.shape and torch.equal(s, t), f"{what}: call {k}, output {i} differs"
    assert sha256([t for o in a for t in o]) == sha256([t for o in b for t in o])


# --------------------------------------------------------------------------- demo decoder
def test_round_trip_is_bit_exact_and_replays(demo):
    model, contract, eps, prog, path, info = demo
    assert info["programs"] == len(eps) and info["bytes"] == path.stat().st_size
    loaded = cf.load(path, replay=FakeBackend(), contract=contract)
    assert isinstance(loaded, cf.OptimizedProgram)
    example = (_inputs(0, 0)[0], *model.initial_state(), _inputs(0, 0)[1])
    loaded.warmup(*example)
    ref = _stream(cf.reference(eps), model.initial_state())
    _assert_same(ref, _stream(prog, model.initial_state()), "fresh program vs ep.module()")
    _assert_same(ref, _stream(loaded, model.initial_state()), "loaded program vs ep.module()")
    c = loaded.counters()
    assert c["replays"] > 0 and c["eager"] == 0, c  # every wrapped partition replayed, none fell back
    assert loaded.stats["passes"] == prog.stats["passes"]
    assert [rp.stored_shape for rp in loaded.plan.regions] == [rp.stored_shape for rp in prog.plan.regions]
    # region outputs sit at the loaded program's own buffers, call after call
    tok, noise = _inputs(1, 0)
    out = loaded(tok, *model.initial_state(), noise)
    assert out[1].data_ptr() == loaded.region_pointer(contract.regions[0].name)


def test_weights_are_stored_once(demo):
    _model, _contract, eps, prog, path, info = demo
    # every program of the catalog shares the weights: the artifact holds one copy, not one per program
    weights = sum(t.numel() * t.element_size() for t in eps[0].state_dict.values())
    assert info["tensor_bytes"] < 2 * weights
    loaded = cf.load(path, replay="off")
    gms = loaded.graph_modules()
    shared = [dict(gm.named_parameters()) for gm in gms]
    for name, p in shared[0].items():
        assert all(s[name] is p for s in shared[1:]), name


def test_sessions_and_lanes_on_the_loaded_program(demo):
    model, _contract, eps, _prog, path, _info = demo
    loaded = cf.load(path, replay=FakeBackend(), lanes=2)
    loaded.warmup(_inputs(0, 0)[0], *model.initial_state(), _inputs(0, 0)[1])
    a, b = loaded.session("a", seed=1), loaded.session("b", seed=2)
    prompt = {s: [t + s * 0.01 for t in model.initial_state()] for s in (1, 2)}
    state = {1: prompt[1], 2: prompt[2]}
    got: dict[int, list] = {1: [], 2: []}
    snap = None
    for k in range(6):
        for seed, sess in ((1, a), (2, b)):
            tok, noise = _inputs(seed, k)
            o = sess(tok, *state[seed], noise)
            got[seed].append([t.clone() for t in live_view(o, LIVE)])
            state[seed] = list(o[1:])
        if k == 2:
            snap = a.snapshot()
    for seed in (1, 2):
        ref = _stream(cf.reference(eps), prompt[seed], seed=seed, calls=6)
        # the reference stream seeds the global generator; the demo draws no random numbers
        _assert_same(ref, got[seed], f"session {seed}")
    # barge-in: back to the snapshot after call 2, the next call equals the stock call from that state
    restored = a.restore(snap)
    tok, noise = _inputs(1, 3)
    regions = sorted(loaded.contract.regions, key=lambda r: loaded.input_index(r.name))
    o = a(tok, *[restored[r.name] for r in regions], noise)
    _assert_same([got[1][3]], [[t.clone() for t in live_view(o, LIVE)]], "after restore")


def test_each_graph_is_decoded_once_per_lane(demo, monkeypatch):
    """load decodes every stored graph ahead (beside the device's start-up) and the first lane uses
    those modules as they are: no graph is decoded twice for one lane, and a further lane copies the
    first lane's modules instead of decoding the graphs again."""
    from cadence_fx.artifact import graph_codec

    _model, _contract, _eps, _prog, path, _info = demo
    calls = []
    real = graph_codec.decode_graph
    monkeypatch.setattr(graph_codec, "decode_graph", lambda spec, dm: calls.append(1) or real(spec, dm))
    one = cf.load(path, replay="off")
    per_lane = len(calls)
    assert per_lane >= len(one.graph_modules()) > 0
    assert {"prebuild_s", "device_init_s", "device_wait_s"} <= set(one.load_report)
    assert one.load_report["device_init_s"] == 0.0  # a CPU artifact starts no device
    calls.clear()
    cf.load(path, replay="off", lanes=2)
    assert len(calls) == per_lane


def test_altered_truncated_or_foreign_files_do_not_load(demo, tmp_path):
    _model, _contract, _eps, _prog, path, _info = demo
    data = path.read_bytes()
    # one weight changed in the file: its digest no longer matches
    payload = torch.load(path, weights_only=True)
    i = max(range(len(payload["tensors"])), key=lambda j: payload["tensors"][j].numel())
    payload["tensors"][i].view(-1)[0] += 1
    changed = tmp_path / "changed.cfx"
    torch.save(payload, changed)
    with pytest.raises(cf.ArtifactError, match=f"tensor {i} .*SHA-256"):
        cf.load(changed)
    # a byte flipped inside that weight's data on disk
    raw = torch.load(path, weights_only=True)["tensors"][i].contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at > 0
    flipped = bytearray(data)
    flipped[at + len(raw) // 2] ^= 0xFF
    (tmp_path / "flipped.cfx").write_bytes(bytes(flipped))
    with pytest.raises(cf.ArtifactError):
        cf.load(tmp_path / "flipped.cfx")
    # the manifest edited (a graph changed) without its digest
    payload = torch.load(path, weights_only=True)
    payload["manifest"] = payload["manifest"].replace('"names":', '"names" :', 1)  # still valid JSON
    torch.save(payload, tmp_path / "manifest.cfx")
    with pytest.raises(cf.ArtifactError, match="manifest"):
        cf.load(tmp_path / "manifest.cfx")
    (tmp_path / "truncated.cfx").write_bytes(data[: len(data) // 2])
    with pytest.raises(cf.ArtifactError, match="not a readable"):
        cf.load(tmp_path / "truncated.cfx")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(cf.ArtifactError, match="not a cadence_fx artifact"):
        cf.load(tmp_path / "other.pt")


def test_another_torch_device_setting_or_contract_is_refused(demo, monkeypatch):
    _model, contract, _eps, _prog, path, _info = demo
    import dataclasses

    other = dataclasses.replace(contract, regions=(
        dataclasses.replace(contract.regions[0], retention=cf.HeadTail(CFG.head, CFG.tail + 1)),
        *contract.regions[1:]))
    with pytest.raises(cf.ArtifactMismatch, match="'regions'"):
        cf.load(path, contract=other)
    with pytest.raises(cf.ArtifactMismatch, match="admit .*refuses"):
        cf.load(path, contract=dataclasses.replace(contract, admit=lambda c: False))
    with pytest.raises(cf.ArtifactMismatch, match="optimized on cpu"):
        cf.load(path, device="cuda" if not torch.cuda.is_available() else "meta")
    previous = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = not previous
        with pytest.raises(cf.ArtifactMismatch, match="cudnn.benchmark"):
            cf.load(path)
    finally:
        torch.backends.cudnn.benchmark = previous
    # the attention backends SDPA may pick are kernel settings too (cuDNN attention is off in the envelope)
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(not previous)
        with pytest.raises(cf.ArtifactMismatch, match=r"enable_cudnn_sdp"):
            cf.load(path)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    with pytest.raises(cf.ArtifactMismatch, match="built with torch"):
        cf.load(path)


def test_verify_mode_is_not_saved(demo, tmp_path):
    _model, contract, eps, _prog, _path, _info = demo
    prog = cf.optimize(eps, contract, verify=True, replay="off")
    with pytest.raises(cf.ArtifactError, match="verify mode"):
        cf.save(prog, tmp_path / "verify.cfx")
    assert not (tmp_path / "verify.cfx").exists()


# --------------------------------------------------------------------------- Token2Wav, reduced sizes
@pytest.fixture(scope="module")
def token2wav(tmp_path_factory):
    # the module pytest collected (tests/ is on sys.path): its catalog cache is shared with its tests
    from test_upstream_cpu import CALLS as T2W_CALLS
    from test_upstream_cpu import full_step_0_1_2, saved_chunk_program_0_1_2

    from cadence_fx.adapters.token2wav import Token2WavConfig

    cfg = Token2WavConfig.reduced()
    # the catalog the upstream tests share (exported with the estimator visible), at the chunk clock
    step, _prompt, state, fresh, _step_contract, eps = full_step_0_1_2(cfg)
    assert len(fresh) == T2W_CALLS
    # eager (replay is the demo tests' concern), saved once for this and the serving tests
    contract, prog, path, _sha = saved_chunk_program_0_1_2(cfg, tmp_path_factory)
    return step, state, fresh[:T2W_STREAM], contract, eps, prog, path


@pytest.mark.upstream
def test_token2wav_round_trip_is_bit_exact(token2wav):
    """Flow chunk (hoisted solver schedule and adaLN constants), both trims, HiFT (folded weight norm,
    device randomness), over a stream through two trims; the loaded program against the fresh one and
    the unmodified programs, and a session of it against its solo stock run. Eager: replay of a loaded
    program is the demo tests' (capture on the CPU costs more calls than the stream)."""
    from test_upstream_cpu import full_step_reference_0_1_2
    from tests.test_upstream_cpu import assert_streams_equal

    from cadence_fx.adapters.token2wav import Token2WavConfig, run_stream

    step, state, fresh, contract, _eps, prog, path = token2wav
    loaded = cf.load(path, replay="off", contract=contract)
    streams = {}
    reference = full_step_reference_0_1_2(Token2WavConfig.reduced())  # the one the upstream tests stream
    for name, fn in (("reference", reference), ("fresh", prog), ("loaded", loaded)):
        torch.manual_seed(11)  # HiFT draws: every run draws the same numbers
        streams[name] = run_stream(fn, step, state, fresh)
    assert_streams_equal(step, contract, streams["reference"], streams["fresh"])
    assert_streams_equal(step, contract, streams["reference"], streams["loaded"])
    assert loaded.stats["passes"]["fold_weights"] > 0 and loaded.stats["passes"]["hoist_constants"] > 0
    # a session of the loaded program: its own random streams, the bytes of a solo run seeded the same
    s = loaded.session("a", seed=11)
    torch.manual_seed(0)
    assert_streams_equal(step, contract, streams["reference"], run_stream(s, step, state, fresh))


@pytest.mark.upstream
def test_token2wav_weight_changed_after_load_is_refused(token2wav):
    step, state, fresh, contract, _eps, _prog, path = token2wav
    loaded = cf.load(path, replay="off")
    guarded = [t for fw in loaded.folded_weights() for _n, t, _v in fw.sources]
    assert guarded  # HiFT's weight-norm parameters, read by folded cones and kept by the program
    args = step.next_args(fresh[0], state)
    loaded(*args)
    loaded.verify_weights()  # the digests optimize took, carried by the artifact, match the loaded bytes
    with torch.no_grad():
        guarded[0].data.mul_(2)  # through .data: the version counter does not see it
    with pytest.raises(cf.WeightsChanged):
        loaded.verify_weights()
    with torch.no_grad():
        guarded[0].mul_(0.5)  # in place: the per-call guard sees it
    with pytest.raises(cf.WeightsChanged):
        loaded(*args)


@pytest.mark.upstream
def test_token2wav_loads_without_the_upstream_code(token2wav, tmp_path):
    """A fresh process that cannot import stepaudio2 nor cadence_fx's model adapters loads the artifact
    and computes the bytes the optimized program computes here."""
    step, state, fresh, _contract, _eps, prog, path = token2wav
    args = step.next_args(fresh[0], state)
    torch.save(list(args), tmp_path / "args.pt")
    torch.manual_seed(3)
    want = sha256([t for t in prog(*[a.clone() for a in args])])
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("stepaudio2", "cosyvoice", "hyperpyyaml") or \\
                        name.startswith("cadence_fx.adapters") or name.startswith("tests"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import torch, cadence_fx as cf
        from cadence_fx.determinism import sha256_tensors
        # the kernel settings the artifact was saved under (tests earlier in the saving process may
        # have pinned the envelope): load refuses any other, as it should
        torch.backends.cudnn.deterministic = {torch.backends.cudnn.deterministic!r}
        torch.backends.cuda.enable_cudnn_sdp({torch.backends.cuda.cudnn_sdp_enabled()!r})
        prog = cf.load({str(path)!r}, replay="off")
        args = torch.load({str(tmp_path / 'args.pt')!r}, weights_only=True)
        torch.manual_seed(3)
        print("SHA", sha256_tensors(list(prog(*args))))
        print("BLOCKED", sorted(m for m in sys.modules if m.startswith(("stepaudio2", "cadence_fx.adapters"))))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("SHA", "BLOCKED")))
    assert lines["SHA"] == want
    assert lines["BLOCKED"] == "[]"


def test_a_program_that_wraps_nothing_is_refused_with_the_way_out(tmp_path):
    """Without a wrapped callable the program's root is ``ExportedProgram.module()`` itself (pytree
    specs, export's input hooks): save refuses it and names the way out (wrap the whole step)."""

    class Step(torch.nn.Module):
        def forward(self, x):
            return x * 2

    ep = torch.export.export(Step(), (torch.randn(2),))
    prog = cf.optimize([ep], cf.Contract(clocks=(cf.Clock("f", 1),)), replay="off")
    with pytest.raises(cf.ArtifactError, match="WHOLE_STEP"):
        cf.save(prog, tmp_path / "step.cfx")


def test_a_float16_autocast_step_with_export_guards_round_trips_bit_exact(tmp_path):
    """A step with an autocast block (lowered by ``inline_autocast``) whose export carries torch.export's
    input guard (``_guards_fn``): the optimized static program no longer calls it (``drop_static_guards``:
    exact-signature dispatch admits less), nothing of it is stored, and the loaded program's stream equals
    the freshly optimized program's, bit for bit."""
    import dataclasses

    from tests.test_autocast import B, D, WINDOW, HalfAttention, _contract

    contract = dataclasses.replace(_contract(WINDOW), wrap=(cf.WHOLE_STEP,))
    example = {"x": torch.randn(B, 2, D), "cache": torch.zeros(B, 2, D, dtype=torch.float16)}
    eps = cf.export_catalog(HalfAttention().eval(), contract, example)
    assert any(type(m).__name__ == "GuardsFn" for ep in eps for m in ep.module().modules())
    prog = cf.optimize(eps, contract, replay="off")
    assert not any(n.op == "call_module" and str(n.target).startswith("_guards")
                   for gm in prog.graph_modules() for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes)
    cf.save(prog, tmp_path / "half.cfx")
    loaded = cf.load(tmp_path / "half.cfx", replay="off")
    g = torch.Generator().manual_seed(1)
    c1 = c2 = torch.randn(B, 2, D, generator=g).half()
    for _ in range(6):
        x = torch.randn(B, 2, D, generator=g)
        with torch.no_grad():
            y1, c1 = prog(x, c1)
            y2, c2 = loaded(x, c2)
        assert torch.equal(y1, y2) and torch.equal(c1, c2)


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-on", "gc-off"])
def test_load_and_optimize_leave_the_garbage_collector_as_they_found_it(demo, tmp_path, enabled):
    """cf.load and cf.optimize pause Python's cyclic collector while they build (cyclic_gc_paused):
    afterwards, and after a load that raises, the collector is on or off as the caller had it."""
    import gc

    _model, contract, eps, _prog, path, _info = demo
    bad = tmp_path / "bad.cfx"
    bad.write_bytes(path.read_bytes()[:1000])
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        cf.load(path, replay=FakeBackend(), lanes=2)
        assert gc.isenabled() is enabled
        cf.optimize(eps, contract, replay=FakeBackend(), lanes=2)
        assert gc.isenabled() is enabled
        with pytest.raises(cf.ArtifactError):
            cf.load(bad)
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
