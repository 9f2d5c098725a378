"""The real Token2Wav decoder (stepaudio2 from PyPI, random weights) under cadence_fx, on the CPU.

Every stream runs the unmodified exported programs (one per catalog class) and the optimized
program side by side from the same state, through at least two trims, and requires:
non-state outputs ``torch.equal``, state outputs equal on what a consumer reads (the live
slots), the SHA-256 over the whole stream equal, and every region output at its buffer's
fixed address on every call.

The upstream packages are found under ``$CADENCE_FX_UPSTREAM`` (default ``<repo>/.upstream``)
as ``minicpmo-0.1.2/`` and ``minicpmo-utils-1.0.7/`` (``pip install --no-deps --target``);
the tests skip when they are missing.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from typing import Sequence

import pytest
import torch

import cadence_fx as cf
from cadence_fx.annotations import WRAPPED
from cadence_fx.adapters.token2wav import (
    CatalogReference, DiTStep, EncoderStep, StreamingStep, Token2WavConfig, Token2WavStep, bounded_vocoder_stream,
    build_causal_vocoder, build_dit, build_encoder, build_flow, build_vocoder, dit_step_contract,
    encoder_step_contract, example_prompt, export_plan_step, export_step_catalog, new_bounded_stream,
    run_stock_stream, run_stream, token2wav_contract)
from cadence_fx.adapters.stepaudio2 import load_stepaudio2
from cadence_fx.determinism import sha256_tensors

pytestmark = pytest.mark.upstream
# Under xdist the tests that read full_step_0_1_2's catalog run on the worker that runs the artifact
# tests, which read it too (tests/conftest.py's "token2wav" unit: every other test here is a unit of
# its own).

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("CADENCE_FX_UPSTREAM", REPO / ".upstream"))
FOLDERS = {"0.1.2": "minicpmo-0.1.2", "1.0.7": "minicpmo-utils-1.0.7"}
CALLS = 6  # classes 16, 26, 36 frames: trims on calls 2..5


def upstream(version: str):
    root = UPSTREAM / FOLDERS[version]
    if not (root / "stepaudio2" / "__init__.py").is_file():
        pytest.skip(f"stepaudio2 {version} is not installed at {root} (set CADENCE_FX_UPSTREAM to a folder with "
                    f"{FOLDERS[version]}/ made by pip install --no-deps --target)")
    up = load_stepaudio2(root)
    assert up.version == version
    return up


_FLOWS: dict[tuple[str, str], tuple[torch.nn.Module, torch.Tensor]] = {}


def built_flow(up, cfg: Token2WavConfig) -> torch.nn.Module:
    """``build_flow(up, cfg)``, built once per release and configuration in this process: each call
    returns a copy and leaves the global generator where the build left it, so a test sees what a
    build of its own gives (the builders seed their own draws: two builds are the same model). The
    build is seconds (the stock CFM allocates its released workspace before the configuration
    shrinks it); a copy is a fraction of one."""
    key = (str(up.root), repr(cfg))
    if key not in _FLOWS:
        flow = build_flow(up, cfg)
        _FLOWS[key] = flow, torch.get_rng_state()
    flow, rng = _FLOWS[key]
    torch.set_rng_state(rng)
    return copy.deepcopy(flow)


@pytest.fixture(scope="module")
def cfg() -> Token2WavConfig:
    return Token2WavConfig.reduced()


# --------------------------------------------------------------------------- checking
def _live(t: torch.Tensor, live: dict[int, int]) -> torch.Tensor:
    for d, n in live.items():
        t = t.narrow(d, 0, min(n, t.shape[d]))
    return t


def consumer_view(step: StreamingStep, contract: cf.Contract, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a consumer reads of one call's outputs: state regions on their live slots only."""
    live = {step.state[r.input]: dict(r.live) for r in contract.regions}
    return [_live(t, live.get(i, {})) for i, t in enumerate(outs)]


def assert_streams_equal(step, contract, ref, opt) -> None:
    regions = {step.state[r.input] for r in contract.regions}
    assert len(ref) == len(opt)
    for k, (r, o) in enumerate(zip(ref, opt)):
        r, o = consumer_view(step, contract, r), consumer_view(step, contract, o)
        for i, (a, b) in enumerate(zip(r, o)):
            what = "state" if i in regions else "output"
            assert a.shape == b.shape and a.dtype == b.dtype, f"call {k}, {what} {i}: {a.shape} vs {b.shape}"
            assert torch.equal(a, b), f"call {k}, {what} {i} differs"
    flat = lambda s: [t for call in s for t in consumer_view(step, contract, call)]  # noqa: E731
    assert sha256_tensors(flat(ref)) == sha256_tensors(flat(opt))


class PointerLog:
    """Records, per call, the data pointer of every region output of an optimized program."""

    def __init__(self, prog: cf.OptimizedProgram, step: StreamingStep, contract: cf.Contract) -> None:
        self.prog, self.index = prog, {r.name: step.state[r.input] for r in contract.regions}
        self.calls: list[dict[str, int]] = []

    def __call__(self, k: int, raw: Sequence[torch.Tensor]) -> None:
        self.calls.append({name: raw[i].data_ptr() for name, i in self.index.items()})

    def assert_stable(self) -> None:
        for name in self.index:
            seen = {c[name] for c in self.calls}
            assert seen == {self.prog.region_pointer(name)}, f"region {name!r} moved: {seen}"


def check_optimized(step, contract, eps, state, fresh, *, verify: bool, restore=None, seed: int = 0,
                    replay="auto", warmup: bool = False, lanes: int = 1, reference: CatalogReference | None = None):
    """Optimize, stream reference and optimized side by side, check everything; returns both streams.
    ``reference``: the catalog's :class:`CatalogReference` when the caller has one (default: a new one)."""
    prog = cf.optimize(eps, contract, verify=verify, replay=replay, lanes=lanes)
    if warmup:
        prog.warmup(*[fresh[0].get(n) for n in step.inputs])
    ref = reference if reference is not None else CatalogReference(eps)
    torch.manual_seed(seed)  # the 0.1.2 HiFT draws random numbers: both runs draw the same ones
    r = run_stream(ref, step, state, fresh, restore=restore)
    log = PointerLog(prog, step, contract)
    torch.manual_seed(seed)
    o = run_stream(prog, step, state, fresh, restore=restore, on_call=log)
    assert_streams_equal(step, contract, r, o)
    log.assert_stable()
    if verify:
        assert prog.auditor.checks > 0
    return prog, r, o


def wrapped_invocations(prog: cf.OptimizedProgram) -> list[list[str]]:
    """Per exported program, the wrapped invocation each partition runs (in graph order)."""
    return [[n.meta[WRAPPED] for n in gm.graph.nodes
             if n.op == "call_module" and n.meta.get(WRAPPED)] for gm in prog.graph_modules()]


def trims(step: StreamingStep, name: str, state, outs) -> int:
    """How many calls shortened the history ``name`` (the driver's trim fired)."""
    extents = [state[name].shape[-2]] + [o[step.state[name]].shape[-2] for o in outs]
    return sum(b <= a for a, b in zip(extents, extents[1:]))


# --------------------------------------------------------------------------- (a) estimator
def test_dit_step_exact(cfg):
    up = upstream("0.1.2")
    step = DiTStep(build_dit(up, cfg), cfg).eval()
    state = step.setup(**step.fresh(1, seed=1, frames=cfg.prompt_frames)[0])
    fresh = step.fresh(CALLS + 1, seed=2)
    contract = dit_step_contract(cfg)
    eps = export_step_catalog(step, state, fresh, contract)
    assert len(eps) == 3
    plan = cf.plan(eps, contract)
    assert list(plan.region("dit_att").extents) == [cfg.prompt_frames + i * cfg.chunk_frames for i in range(3)]
    reference = CatalogReference(eps)
    for verify in (False, True):
        prog, ref, _ = check_optimized(step, contract, eps, state, fresh, verify=verify, reference=reference)
        assert prog.stats["passes"]["retention_in_place"] > 0
    assert trims(step, "att_cache", state, ref) >= 2
    # the exported program is the stock computation: same as calling DiT.forward_chunk eagerly
    eager = run_stream(step, step, state, fresh)
    assert all(torch.equal(a, b) for x, y in zip(ref, eager) for a, b in zip(x, y))


# --------------------------------------------------------------------------- (b) conformer encoder
@pytest.mark.parametrize("version", ["0.1.2", "1.0.7"])
def test_encoder_step_exact(cfg, version):
    """The encoder (1.0.7: behind ``torch.compile``, exported through the function it wraps), 0.1.2 trim."""
    up = upstream(version)
    step = EncoderStep(build_encoder(up, cfg), cfg, driver="0.1.2").eval()
    g = torch.Generator().manual_seed(3)
    state = step.setup(torch.randn(1, cfg.prompt_tokens + cfg.pre_lookahead_len, cfg.input_size, generator=g))
    assert state["att_cache"].shape[3] == cfg.prompt_frames
    fresh = step.fresh(CALLS + 1, seed=4)
    contract = encoder_step_contract(cfg)
    eps = export_step_catalog(step, state, fresh, contract)
    assert len(eps) == 3
    reference = CatalogReference(eps)
    for verify in (False, True):
        _prog, ref, _ = check_optimized(step, contract, eps, state, fresh, verify=verify, reference=reference)
    assert trims(step, "att_cache", state, ref) >= 2
    # the exported programs compute what the step computes eagerly (the decorated 1.0.7 entry point
    # is compared in test_full_step_1_0_7, through the stock driver)
    eager = run_stream(step, step, state, fresh)
    assert all(torch.equal(a, b) for x, y in zip(ref, eager) for a, b in zip(x, y))


def test_encoder_1_0_7_trim_is_copied_and_exact(cfg):
    """1.0.7 trims the token-rate and mel-rate halves of the packed cache separately and repacks them
    along dim 0: no slices of one concatenation describe that. The core does not guess which positions
    are kept: the region's new value is copied into its buffer whole, reported, and the stream is exact."""
    up = upstream("1.0.7")
    step = EncoderStep(build_encoder(up, cfg), cfg, driver="1.0.7").eval()
    g = torch.Generator().manual_seed(3)
    state = step.setup(torch.randn(1, cfg.prompt_tokens + cfg.pre_lookahead_len, cfg.input_size, generator=g))
    contract = encoder_step_contract(cfg)
    fresh = step.fresh(CALLS + 1, seed=4)
    eps = export_step_catalog(step, state, fresh, contract)
    prog, _ref, _ = check_optimized(step, contract, eps, state, fresh, verify=False)
    kinds = {(f.pattern, f.subject) for row in cf.state_traffic(prog) for f in row["left_stock"]}
    assert ("state_copied", "conformer_att") in kinds


# --------------------------------------------------------------------------- (c) the full step
_CATALOGS: dict[str, tuple] = {}


def full_step_0_1_2(cfg):
    """The 0.1.2 step with HiFT from the prompt, its step-clock contract and its catalog, exported with
    the estimator visible (the "step" routing), which serves the chunk clock too.

    One export per ``cfg`` for the whole session, shared by the full-step, replay and artifact tests:
    the export is the slow part on the CPU, and callers only read what it returns. (The chunk-routed
    export is the example's and the float16 test's.)"""
    key = repr(cfg)
    if key not in _CATALOGS:
        up = upstream("0.1.2")
        step = Token2WavStep(built_flow(up, cfg), build_vocoder(up, cfg), cfg, driver="0.1.2").eval()
        prompt = example_prompt(cfg)
        state = step.setup(*prompt)
        fresh = step.fresh(CALLS, prompt[2], seed=7)
        contract = token2wav_contract(cfg, "step", driver="0.1.2")
        eps = export_step_catalog(step, state, fresh, contract, granularity="step")
        _CATALOGS[key] = step, prompt, state, fresh, contract, eps
    return _CATALOGS[key]


_REFERENCES: dict[str, CatalogReference] = {}


def full_step_reference_0_1_2(cfg) -> CatalogReference:
    """:func:`full_step_0_1_2`'s catalog unmodified (:class:`CatalogReference`), built once per session
    for the tests that share the catalog: building one is ``ep.module()`` of every program, seconds for
    these graphs, and the modules of one program share its parameters and buffers, so every stream of
    it is the stream a new reference gives."""
    key = repr(cfg)
    if key not in _REFERENCES:
        _REFERENCES[key] = CatalogReference(full_step_0_1_2(cfg)[-1])
    return _REFERENCES[key]


_SAVED: dict[str, tuple] = {}


def saved_chunk_program_0_1_2(cfg, tmp_path_factory):
    """:func:`full_step_0_1_2`'s catalog at the chunk clock, optimized eagerly (replay off: capture on
    the CPU costs more calls than the streams) and saved once per session: ``(contract, program, path,
    sha256)``. The artifact and serving tests share it (the optimize and the save are most of their
    set-up); they read the file, and only the artifact tests call the program."""
    key = repr(cfg)
    if key not in _SAVED:
        *_, eps = full_step_0_1_2(cfg)
        contract = token2wav_contract(cfg, "chunk", driver="0.1.2")
        prog = cf.optimize(eps, contract, replay="off")
        path = tmp_path_factory.mktemp("token2wav-artifact") / "token2wav.cfx"
        _SAVED[key] = contract, prog, path, cf.save(prog, path)["sha256"]
        with _shared_artifact(tmp_path_factory, key) as (shared, digest_file):
            if not digest_file.exists():
                shutil.copyfile(path, shared)
                digest_file.write_text(_SAVED[key][3])
    return _SAVED[key]


@contextlib.contextmanager
def _shared_artifact(tmp_path_factory, key: str):
    """The session's one place for the saved chunk program, which every pytest-xdist worker of the run
    sees (their base temp's parent), held under a file lock: ``(artifact path, digest file)``."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    with open(root / f"token2wav-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield root / f"token2wav-{name}.cfx", root / f"token2wav-{name}.sha256"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def shared_chunk_artifact_0_1_2(cfg, tmp_path_factory) -> tuple[cf.Contract, Path, str]:
    """:func:`saved_chunk_program_0_1_2`'s artifact for a test that only loads it (the serving tests):
    ``(contract, path, sha256)``, from the file another worker of this run saved when there is one (the
    export and the optimize are a minute and a half on the CPU), else saved here."""
    key = repr(cfg)
    contract = token2wav_contract(cfg, "chunk", driver="0.1.2")
    with _shared_artifact(tmp_path_factory, key) as (shared, digest_file):
        if digest_file.exists():
            return contract, shared, digest_file.read_text()
    contract, _prog, path, digest = saved_chunk_program_0_1_2(cfg, tmp_path_factory)
    return contract, path, digest


def test_full_step_0_1_2(cfg):
    """Flow chunk + both trims + HiFT (mel/source/speech caches, fade, device randomness), chunk clock,
    verify mode, and a mid-stream rollback to an earlier snapshot (foreign tensors copied in)."""
    step, (ptok, pmel, spk), state, fresh, _step_contract, eps = full_step_0_1_2(cfg)
    contract = token2wav_contract(cfg, "chunk", driver="0.1.2")
    assert len(eps) == 3

    reference = full_step_reference_0_1_2(cfg)
    torch.manual_seed(11)
    plain = run_stream(reference, step, state, fresh)
    assert trims(step, "estimator_att", state, plain) >= 2
    assert trims(step, "conformer_att", state, plain) >= 2
    # the exported step is the stock driver: Token2wav.stream's work, eagerly, draws the same numbers
    torch.manual_seed(11)
    stock = run_stock_stream(step, ptok, pmel, spk, [f["token"] for f in fresh])
    assert sha256_tensors([t for c in stock for t in c]) == sha256_tensors([t for c in plain for t in c])

    # roll back to the state after call 0 (26 frames of history) before call 4 (36 frames)
    snapshot = {k: v.clone() for k, v in step.carry(plain[0]).items()}
    prog, ref, opt = check_optimized(step, contract, eps, state, fresh, verify=True, restore={4: snapshot}, seed=11,
                                     reference=reference)
    assert ref[4][step.state["estimator_att"]].shape[4] == cfg.prompt_frames + 2 * cfg.chunk_frames
    # chunk clock: encoder, the CFM loop in one segment per solver step (the adapter's default), the
    # vocoder in two segments (its istft checks the window envelope on the host every call, so it runs
    # eagerly between them)
    for names in wrapped_invocations(prog):
        assert [n.split("__")[-1] for n in names] == (
            ["flow.encoder"] + ["flow.decoder"] * cfg.n_timesteps + ["vocoder", "vocoder"]), names
    assert all(torch.equal(a, b) for x, y in zip(ref[:4], plain[:4]) for a, b in zip(x, y))
    assert prog.stats["state_adopted"] == 2 * len(contract.regions)  # first call and the restore only
    # the solver's history lives in the region buffer (envelope layout), not in a workspace of its own
    assert prog.stats["passes"]["envelope_state"] == len(eps)
    assert next(r for r in prog.plan.regions if r.name == "estimator_att").layout == "envelope"
    # the solver's per-step conv cache buffer is written before it is read every call: scratch, not state
    # (sessions are allowed); nothing else of the modules is written
    assert prog.undeclared_state() == {}


@pytest.fixture(scope="module")
def step_catalog(cfg):
    """The 0.1.2 step exported with the estimator visible (the "step" routing): one catalog serves both
    clocks, so the replay tests below share one export (the slow part on the CPU)."""
    return full_step_0_1_2(cfg)


def test_chunk_clock_whole_cfm_loop_as_one_graph(cfg, step_catalog):
    """``step_segments=False``: the CFM loop is one partition (one graph); same bits."""
    from cadence_fx.testing.fake_backend import FakeBackend

    step, _prompt, state, fresh, _contract, eps = step_catalog
    contract = token2wav_contract(cfg, "chunk", driver="0.1.2", step_segments=False)
    prog, _ref, _opt = check_optimized(step, contract, eps, state, fresh, verify=False, seed=13,
                                       replay=FakeBackend(), warmup=True, reference=full_step_reference_0_1_2(cfg))
    for names in wrapped_invocations(prog):
        assert [n.split("__")[-1] for n in names] == ["flow.encoder", "flow.decoder", "vocoder", "vocoder"], names
    # the flow replays every call (on the CPU, HiFT's draws are host randomness: it stays eager here)
    flow = {k: e for k, e in prog.runners().items() if "flow" in k}
    assert len(flow) == 2 * 3 and all(e.counters.eager == 0 and e.counters.replays > 0 for e in flow.values())


@pytest.mark.parametrize("segments", [False, True], ids=["step-clock", "chunk-clock-step-segments"])
def test_each_solver_step_replays_on_views_of_the_region(cfg, step_catalog, segments):
    """0.1.2 through the fake replay backend, one graph per solver step: at the step clock (each step's
    cache slice is cut by the eager CFM loop between two replayed partitions) and at the chunk clock
    split at the estimator (``split_at``). The slice is a view of the region buffer, passed in place
    (aliased, pointer-checked), not staged, and the stream stays bit-exact."""
    from cadence_fx.testing.fake_backend import FakeBackend

    step, _prompt, state, fresh, contract, eps = step_catalog
    if segments:
        contract = token2wav_contract(cfg, "chunk", driver="0.1.2")  # segments: the default
    prog, ref, _opt = check_optimized(step, contract, eps, state, fresh, verify=False, seed=13,
                                      replay=FakeBackend(), warmup=True, lanes=2 if segments else 1,
                                      reference=full_step_reference_0_1_2(cfg))
    # one engine per solver step and class: the estimator's (step clock) or the CFM loop's segments
    is_step = (lambda k: k.split(":")[-1].startswith("L__self__flow.decoder")) if segments else (  # noqa: E731
        lambda k: ".estimator" in k)
    estimators = {k: e for k, e in prog.runners().items() if is_step(k) and not k.startswith("lane")}
    assert len(estimators) == 3 * cfg.n_timesteps, sorted(prog.runners())
    for eng in estimators.values():
        assert eng.counters.eager == 0 and eng.counters.invalidations == 0 and eng.counters.replays > 0
        # only the step's inputs (x, t, mu, spks, cond: a few KiB) are staged, never a cache
        assert all(r.staging_bytes < 64 << 10 for r in eng.classes.values()), [r.staging_bytes for r in eng.classes.values()]
    if segments:
        _two_conversations_on_a_copied_lane(prog, step, contract, full_step_reference_0_1_2(cfg), state, fresh, ref)


def _two_conversations_on_a_copied_lane(prog, step, contract, reference, state, fresh, ref13) -> None:
    """``lanes=2``: lane 1 is a copy of lane 0's rewritten programs (the passes ran once). Two seeded
    sessions from two threads give their solo stock streams' bytes, and the copied lane served calls
    (sessions prefer the lane the default session's state is not resident in)."""
    import threading

    got: dict[int, list] = {}
    go = threading.Barrier(2)

    def converse(seed: int) -> None:
        session = prog.session(f"s{seed}", seed=seed)
        go.wait()
        got[seed] = run_stream(session, step, state, fresh)

    threads = [threading.Thread(target=converse, args=(s,)) for s in (13, 21)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.manual_seed(21)
    solo = {13: ref13, 21: run_stream(reference, step, state, fresh)}
    for seed in (13, 21):
        assert_streams_equal(step, contract, solo[seed], got[seed])
    # the flow's graphs (on the CPU, HiFT's draws are host randomness: it stays eager)
    lane1 = [e.counters for k, e in prog.runners().items() if k.startswith("lane1/") and "flow" in k]
    assert lane1 and sum(c.replays for c in lane1) > 0 and sum(c.eager for c in lane1) == 0


def test_full_step_1_0_7(cfg):
    """1.0.7: flow chunk + both 1.0.7 trims, step clock (one partition per solver step), then the
    1.0.7 ``BoundedVocoder`` on the step's mel, eagerly, as its driver runs it."""
    up = upstream("1.0.7")
    step = Token2WavStep(built_flow(up, cfg), None, cfg, driver="1.0.7").eval()
    ptok, pmel, spk = example_prompt(cfg)
    state = step.setup(ptok, pmel, spk)
    fresh = step.fresh(CALLS, spk, seed=6)
    contract = token2wav_contract(cfg, "step", driver="1.0.7", vocoder=False)
    assert "conformer_att" not in {r.name for r in contract.regions}  # passes through unmanaged
    # export traces the function torch.compile wraps; its eager walk through the catalog (the step's
    # own forward, not the stock driver) would compile the encoder once more for nothing, as the
    # walk's tensors are not inference tensors like the driver's: that walk runs uncompiled here, and
    # the stock stream below goes through torch.compile as the driver does
    with torch.compiler.set_stance("force_eager"):
        eps = export_step_catalog(step, state, fresh, contract, granularity="step")
    assert len(eps) == 3

    reference = CatalogReference(eps)
    ref_plain = run_stream(reference, step, state, fresh)
    snapshot = {k: v.clone() for k, v in step.carry(ref_plain[0]).items()}
    prog, ref, opt = check_optimized(step, contract, eps, state, fresh, verify=False, restore={4: snapshot},
                                     reference=reference)
    assert trims(step, "estimator_att", state, ref_plain) >= 2
    for names in wrapped_invocations(prog):  # step clock: one partition per solver step
        assert len(names) == 1 + cfg.n_timesteps and "flow.encoder" in names[0], names
        assert all(".estimator" in n for n in names[1:]) and len(set(names[1:])) == cfg.n_timesteps, names

    # the stock 1.0.7 stream (decorated entry points, torch.compile'd encoder) + its bounded vocoder
    stock = run_stream(step.stock_call, step, state, fresh)
    hift_ref = build_causal_vocoder(up, cfg)
    hift_opt = new_bounded_stream(up, hift_ref.model)
    pcm_stock = [bounded_vocoder_stream(hift_ref, c[0], cfg) for c in stock]
    pcm_opt = [bounded_vocoder_stream(hift_opt, c[0], cfg) for c in opt[:4]]
    assert all(torch.equal(a, b) for x, y in zip(stock, ref_plain) for a, b in zip(x, y))
    assert sum(p.shape[-1] for p in pcm_stock) > 0
    assert sha256_tensors(pcm_stock[:4]) == sha256_tensors(pcm_opt)


def test_bounded_vocoder_decode_replays_bit_exact(cfg, caplog):
    """1.0.7's ``BoundedVocoder``: its stateless ``decode`` exported per shape seen on example mel,
    optimized (istft eager between two replayed segments), captured per layout the stream passes (views
    of its caches), installed as the model's ``decode``; the host bookkeeping stays stock. The PCM
    stream is bit-identical; the flush call's shapes are outside the catalog: eager, counted, logged once."""
    from cadence_fx.adapters.bounded_vocoder import replay_bounded_vocoder
    from cadence_fx.testing.fake_backend import FakeBackend

    up = upstream("1.0.7")
    ref = build_causal_vocoder(up, cfg)
    g = torch.Generator().manual_seed(0)
    mels = [torch.randn(1, cfg.mel_channels, 2 * cfg.chunk_frames, generator=g) for _ in range(10)]
    pcm_ref = [bounded_vocoder_stream(ref, m, cfg, last_chunk=k == 9) for k, m in enumerate(mels)]

    opt = new_bounded_stream(up, ref.model)
    installed = replay_bounded_vocoder(opt, mels[:5], replay=FakeBackend())
    assert ref.model.decode is installed and len(installed.catalog) >= 2
    pcm_opt = [bounded_vocoder_stream(opt, m, cfg, last_chunk=k == 9) for k, m in enumerate(mels)]
    assert sum(p.shape[-1] for p in pcm_ref) > 0
    assert sha256_tensors(pcm_ref) == sha256_tensors(pcm_opt)
    c = installed.counters()
    assert c["optimized"] >= 2 * 9 and c["replay"][False]["eager"] == 0 and c["replay"][False]["replays"] > 0
    assert c["eager"] and all(sig[-1] is True for sig in c["eager"])  # only the flush ran stock
    flush_warnings = [r for r in caplog.records if "outside the catalog" in r.getMessage()]
    assert len(flush_warnings) == len(c["eager"])


# --------------------------------------------------------------------------- (d) the plan, released size
def test_plan_released_dimensions():
    """The released estimator workspace (16 step slots x 1000 frames) against what the contract
    demands (10 steps x 452 frames), from one export of the released flow step with a single solver
    step (the plan reads shapes only; the contract carries the 10 steps)."""
    up = upstream("0.1.2")
    ep, contract = export_plan_step(up)
    plan = cf.plan(ep, contract)
    text = str(plan)
    print(text)
    est = plan.region("estimator_att")
    assert est.static_shape == (16, 16, 2, 8, 1000, 128)
    assert est.demand_shape == (10, 16, 2, 8, 452, 128)
    assert est.over_reservation == pytest.approx(16 * 1000 / (10 * 452))
    assert list(est.extents) == [302, 352, 402]
    assert "3.54x over-reserved" in text
    # stored in the envelope layout: the region buffer is that demand, and the workspace goes
    assert est.layout == "envelope" and est.stored_shape == est.demand_shape
    assert est.session_shape == (10, 16, 2, 8, 402, 128)  # a session stores the attended history only


# --------------------------------------------------------------------------- (e) the example script
def test_token2wav_example_streams_bit_identical(capsys):
    """examples/token2wav.py (what a user's export script does) at reduced size: stock and optimized
    PCM streams have the same SHA-256."""
    upstream("0.1.2")  # skips when the upstream release is not installed
    import importlib.util

    spec = importlib.util.spec_from_file_location("token2wav_example", REPO / "examples" / "token2wav.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--reduced", "--chunks", "2"]) is True  # two catalog classes: each export is a minute
    assert "bit-identical        : True" in capsys.readouterr().out


def test_driver_state_handling_gives_the_stock_call_bytes(cfg):
    """The stock driver keeps the flow state as inference_chunk returns it (no copies); the benchmark's
    stock_call clones every output. Same bytes either way, call after call."""
    up = upstream("0.1.2")
    torch.manual_seed(3)
    step = Token2WavStep(built_flow(up, cfg), build_vocoder(up, cfg), cfg, driver="0.1.2").eval()
    prompt = example_prompt(cfg)
    state = step.setup(*prompt)
    fresh = step.fresh(4, prompt[2], seed=8)
    torch.manual_seed(11)
    cloned = run_stream(step.stock_call, step, state, fresh)
    torch.manual_seed(11)
    driver = run_stream(step.driver_call, step, state, fresh)
    assert sha256_tensors([t for c in cloned for t in c]) == sha256_tensors([t for c in driver for t in c])
    # driver_stream takes the state over, as Token2wav.stream owns its cache dict: the caller's dict
    # is emptied on entry (nothing of the previous state lives through the call), same bytes
    torch.manual_seed(11)
    st, handed = {k: v.clone() for k, v in state.items()}, []
    for f in fresh:
        given = st
        with torch.no_grad():
            out = step.driver_stream(f, given)
        assert given == {}
        handed.append(tuple(t.clone() for t in out))  # the flow state may be views of the CFM workspace
        st = step.carry(out)
    assert sha256_tensors([t for c in handed for t in c]) == sha256_tensors([t for c in driver for t in c])


def test_full_step_0_1_2_float16():
    """The stock float16 switch (``Token2wav(float16=True)``: the flow in half, its calls under float16
    autocast, HiFT in float32): the autocast block is lowered by ``inline_autocast`` and the optimized
    stream equals the unmodified programs and the stock driver, bit for bit (CPU autocast). One solver
    step keeps the CPU suite short; the float16 path is the same at every step."""
    cfg = Token2WavConfig.reduced(n_timesteps=1)
    up = upstream("0.1.2")
    step = Token2WavStep(built_flow(up, cfg).half(), build_vocoder(up, cfg), cfg, driver="0.1.2", float16=True).eval()
    prompt = example_prompt(cfg)
    state = step.setup(*prompt)
    assert state["estimator_att"].dtype == torch.float16 and state["mel_cache"].dtype == torch.float32
    fresh = step.fresh(4, prompt[2], seed=2)
    contract = token2wav_contract(cfg, "chunk", driver="0.1.2")
    eps = export_step_catalog(step, state, fresh, contract, granularity="chunk")
    torch.manual_seed(7)
    stock = run_stream(step.driver_call, step, state, fresh)
    prog, ref, _opt = check_optimized(step, contract, eps, state, fresh, verify=False, replay="off", seed=7)
    # Only HiFT's draws are marked: the flow's fused attention (dropout 0) draws nothing.
    assert prog.stats["passes"]["mark_randomness"] == len(eps)
    assert prog.stats["passes"]["inline_autocast"] == len(eps)
    # the solver's history workspace, written inside the autocast block, is the region buffer there too
    assert prog.stats["passes"]["envelope_state"] == len(eps)
    assert sha256_tensors([t for c in stock for t in c]) == sha256_tensors([t for c in ref for t in c])
    with pytest.raises(ValueError, match="half"):
        Token2WavStep(built_flow(up, cfg), None, cfg, float16=True)


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "float16"])
def test_example_state_is_shaped_and_typed_like_the_prompt_state(cfg, half):
    """``example_state`` (what planning exports from, without running the prompt) has the shapes and
    dtypes of the state ``setup`` returns: under the float16 switch the flow's caches are half."""
    up = upstream("0.1.2")
    flow = built_flow(up, cfg)
    step = Token2WavStep(flow.half() if half else flow, build_vocoder(up, cfg), cfg, float16=half).eval()
    state = step.setup(*example_prompt(cfg))
    example = step.example_state()
    assert {k: (v.shape, v.dtype) for k, v in example.items()} == {k: (v.shape, v.dtype) for k, v in state.items()}
