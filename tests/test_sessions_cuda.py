"""Sessions on the GPU: lanes on their own streams, calls from threads, bytes independent of neighbours."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog
from cadence_fx.determinism import pin_envelope
from tests.helpers import live_view, sha256

pytestmark = pytest.mark.cuda
CFG = DemoConfig(dim=64, chunk=8, prompt=24, head=24, tail=16, steps=4, slots=6, capacity=128)
LIVE = {2: {0: CFG.steps}}


def _fresh(seed, k):
    g = torch.Generator().manual_seed(seed * 1000 + k)
    return (torch.randn(1, CFG.chunk, CFG.dim, generator=g).cuda(), torch.randn(1, CFG.chunk, CFG.dim, generator=g).cuda())


def _stream(fn, state0, seed, calls, *, clone_state):
    state, outs = [s.clone() for s in state0], []
    for k in range(calls):
        tok, noise = _fresh(seed, k)
        o = fn(tok, *state, noise)
        outs.append([t.clone() for t in live_view(o, LIVE)])
        state = [t.clone() for t in o[1:]] if clone_state else list(o[1:])
    return sha256([t for o in outs for t in o])


def _demo_program(lanes: int, *, warm: bool = True):
    """The demo decoder on the GPU optimized with ``lanes`` lanes (warmed up), a reference catalog
    exported from a copy of the model, and the initial state: ``(prog, ref_eps, state0)``."""
    pin_envelope()
    torch.manual_seed(0)
    model = StreamingDecoder(CFG).eval().cuda()
    contract = demo_contract(CFG)
    eps = export_catalog(model, contract, device="cuda")
    ref_eps = export_catalog(copy.deepcopy(model), contract, device="cuda")
    prog = cf.optimize(eps, contract, lanes=lanes)
    state0 = [s + 0 for s in model.initial_state(device="cuda")]
    if warm:
        prog.warmup(*_fresh(0, 0)[:1], *state0, _fresh(0, 0)[1])
    return prog, ref_eps, state0


def test_sessions_on_lanes_from_threads_are_bit_exact_alone_and_concurrent():
    prog, ref_eps, state0 = _demo_program(3)
    calls = 12
    solo = {s: _stream(cf.reference(ref_eps), [x + s * 0.01 for x in state0], s, calls, clone_state=True) for s in range(6)}
    alone = _stream(prog.session(), [x + 0.0 for x in state0], 0, calls, clone_state=False)
    digests: dict[int, str] = {}
    held = {s: prog.session(f"s{s}") for s in range(6)}  # sessions are held weakly by the program

    def run(s):
        digests[s] = _stream(held[s], [x + s * 0.01 for x in state0], s, calls, clone_state=False)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert alone == solo[0]
    assert digests == solo, {s: (digests.get(s, "")[:8], solo[s][:8]) for s in solo}
    c = prog.counters()
    assert c["eager"] == 0 and c["replays"] == 2 * calls * 7, c
    lanes_used = {k.split("/")[0] for k, e in prog.runners().items() if e.counters.replays}
    print(f"\n[sessions-cuda] 6 sessions on 3 lanes from 6 threads: every SHA-256 equals its solo run; "
          f"lanes used {sorted(lanes_used)}; counters {c}; per-session {prog.sessions()[0].nbytes()} bytes")


def test_a_lane_called_from_two_streams_runs_each_call_after_the_last():
    """Lane 0 has no stream of its own: each call runs on its caller's stream, and the host hands the
    lane to the next caller as soon as a call returns, while the device may still be running it (here
    behind a sleep queued first on the caller's stream). A second caller on another stream must wait
    for it: its copy-in would otherwise land in the region buffers before the first call's graphs read
    them. One lane, two sessions, two streams, one thread: each session equals its solo run."""
    prog, ref_eps, state0 = _demo_program(1)
    calls = 4
    sessions = {1: prog.session("a"), 2: prog.session("b")}
    streams = {1: torch.cuda.Stream(), 2: torch.cuda.Stream()}
    state = {s: [x + s * 0.01 for x in state0] for s in (1, 2)}
    outs: dict[int, list] = {1: [], 2: []}
    for k in range(calls):
        for s in (1, 2):
            with torch.cuda.stream(streams[s]):
                if s == 1:
                    torch.cuda._sleep(100_000_000)  # tens of ms of device work ahead of session a's call
                tok, noise = _fresh(s, k)
                o = sessions[s](tok, *state[s], noise)
                outs[s].append([t.clone() for t in live_view(o, LIVE)])
                state[s] = list(o[1:])
    torch.cuda.synchronize()
    for s in (1, 2):
        solo = _stream(cf.reference(ref_eps), [x + s * 0.01 for x in state0], s, calls, clone_state=True)
        assert sha256([t for o in outs[s] for t in o]) == solo, f"session {s}"
    print("\n[sessions-cuda] one lane, two caller streams, the first behind a sleep: both sessions equal their solo runs")


def test_no_stream_a_caller_makes_is_a_lanes_stream():
    """Lanes run on streams of PyTorch's high-priority pool: the default-priority streams callers make
    (handed out round robin, 32 per device) never alias a lane's, so a caller's own copies never queue
    behind another session's chunk on that lane."""
    prog, _ref_eps, _state0 = _demo_program(4, warm=False)
    lanes = {ln.stream.cuda_stream for ln in prog.lanes.lanes if ln.stream is not None}
    assert len(lanes) == 3
    callers = {torch.cuda.Stream().cuda_stream for _ in range(64)}  # twice round the pool
    assert not lanes & callers


class _Draws(torch.nn.Module):
    """A wrapped callable that computes, then draws (as HiFT's sine source does inside the vocoder)."""

    def __init__(self, depth: int):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(depth)])
        self.out = torch.nn.Linear(64, 64)

    def forward(self, h):
        h = self.body(h)
        return self.out(h + torch.rand_like(h) + torch.randn_like(h))


class Noisy(torch.nn.Module):
    def __init__(self, depth: int = 16):
        super().__init__()
        self.lin = _Draws(depth)

    def forward(self, x, cache):
        kv = torch.cat([cache, x], 1)
        return self.lin(kv.mean(1)), kv[:, -16:]


def _noisy(*, depth: int, lanes: int):
    """The drawing step exported with its window contract and optimized with ``lanes`` lanes: (eps, prog)."""
    contract = cf.Contract(clocks=(cf.Clock("frame", 4),), wrap=("lin",), regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(16), initial=16),))
    step = Noisy(depth).eval().cuda()
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(1, 4, 64, device="cuda"),
                                             "cache": torch.zeros(1, 16, 64, device="cuda")})
    return eps, cf.optimize(eps, contract, lanes=lanes)


def _noisy_solo(eps, xs, seed) -> str:
    """A seeded conversation of the drawing step alone through the unmodified programs."""
    torch.manual_seed(seed)
    ref, c, out = cf.reference(eps), torch.zeros(1, 16, 64, device="cuda"), []
    for x in xs:
        y, c = ref(x, c)
        out.append(y.clone())
    return sha256(out)


def _noisy_streams(prog, xs, seeds, *, own_streams: bool = True) -> dict[int, str]:
    """One seeded session per seed, each streaming ``xs`` from a thread of its own (on a stream of its own
    with ``own_streams``): each session's SHA-256."""
    got: dict[int, str] = {}

    def run(s):
        with torch.cuda.stream(torch.cuda.Stream()) if own_streams else contextlib.nullcontext():
            sess, c, out = prog.session(seed=s), torch.zeros(1, 16, 64, device="cuda"), []
            for x in xs:
                y, c = sess(x, c)
                out.append(y.clone())
            torch.cuda.current_stream().synchronize()
            got[s] = sha256(out)

    threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


@pytest.mark.parametrize("lockless", [False, True], ids=["locked", "lockless"])
@pytest.mark.parametrize("mismarked", [False, True], ids=["marked", "draw-found-at-capture"])
def test_each_session_replays_its_own_device_random_stream_concurrently(mismarked, lockless, monkeypatch, caplog):
    """Four seeded sessions on two lanes from four threads: each equals its solo run. The lanes' graphs
    that draw are captured and replayed under each lane's own generator state, so their replays are not
    ordered across lanes. ``draw-found-at-capture``: the partition is not marked as drawing (as if an op
    drew without saying so); its capture sees the draw and its calls switch to the session streams."""
    from cadence_fx.passes import mark_randomness
    from cadence_fx.runtime import rng

    if mismarked:
        monkeypatch.setattr(mark_randomness, "draws", lambda n: False)
    # lockless: a replay inside a session loads the session's stream into the lane's state itself
    # (CADENCE_FX_LOCKLESS_DRAW_REPLAY), taking the draws' lock only for eager fallbacks
    monkeypatch.setattr(rng, "LOCKLESS_DRAW_REPLAY", lockless)
    rng._last_replay = None
    pin_envelope()
    eps, prog = _noisy(depth=16, lanes=2)
    prog.warmup()
    xs = [torch.randn(1, 4, 64, device="cuda") for _ in range(10)]
    want = {s: _noisy_solo(eps, xs, s) for s in range(4)}
    rng.draw_lock_stats(reset=True)
    assert _noisy_streams(prog, xs, range(4), own_streams=False) == want
    c = prog.counters()
    assert c["replays"] == 40 and c["eager"] == 0, c
    if rng.GraphGenerator.supported():
        assert rng._last_replay is None, "replays that draw were ordered across lanes"
    assert any("no op in it is a draw" in r.getMessage() for r in caplog.records) == mismarked
    if lockless and not mismarked:  # (a mismarked partition's first calls ran before it was known to draw)
        assert rng.draw_lock_stats()["acquired"] == 0, rng.draw_lock_stats()
    print(f"\n[sessions-cuda] 4 seeded sessions, device RNG replayed on 2 lanes from 4 threads: each equals its "
          f"solo run (torch.manual_seed(seed)); counters {c}")


def test_cuda_lanes_are_captured_before_traffic_unless_asked():
    """Fail closed: beside traffic is not proven exact on the GPU, so warmup_in_background captures every
    CUDA lane before it returns (and says so) unless CADENCE_FX_CAPTURE_BESIDE_TRAFFIC=1."""
    pin_envelope()
    _eps, prog = _noisy(depth=2, lanes=3)
    warming = prog.warmup_in_background(first=1)
    assert not warming.beside and warming.done and prog.lanes.online() == 3
    assert prog.counters()["captures"] == 3


@pytest.mark.xfail(reason="session 20 on the H200: sessions streamed beside the capture gave other bytes than "
                          "their solo runs; cause not found (the one-lane control below did not run)", strict=False)
def test_lanes_captured_beside_traffic_replay_every_session_exactly(monkeypatch):
    """warmup_in_background: lane 0 captured first, lanes 1-3 captured on a background thread (thread_local
    capture mode, no device-wide synchronize, every draw held around each class) while eight seeded sessions
    that draw stream from eight threads. Every session equals its solo run; the late lanes then serve, each
    replaying, and nothing ran eagerly."""
    pin_envelope()
    eps, prog = _noisy(depth=48, lanes=4)  # captures long enough to overlap the traffic
    xs = [torch.randn(1, 4, 64, device="cuda") for _ in range(24)]
    want = {s: _noisy_solo(eps, xs, s) for s in range(16)}

    monkeypatch.setenv("CADENCE_FX_CAPTURE_BESIDE_TRAFFIC", "1")
    warming = prog.warmup_in_background(first=1)
    assert warming.beside
    online_at_start = prog.lanes.online()
    during = _noisy_streams(prog, xs, range(8))
    online_after_traffic = prog.lanes.online()
    warming.wait(120)
    after = _noisy_streams(prog, xs, range(8, 16))
    assert during == {s: want[s] for s in range(8)}, sorted(s for s in range(8) if during.get(s) != want[s])
    assert after == {s: want[s] for s in range(8, 16)}
    c = prog.counters()
    assert c["eager"] == 0 and c["captures"] == 4, c
    late = {k.split("/")[0] for k, e in prog.runners().items() if e.counters.replays and k.startswith("lane")}
    assert late, prog.runners().keys()
    print(f"\n[sessions-cuda] beside traffic: {online_at_start} lane(s) online at the start, {online_after_traffic} "
          f"after 8 sessions streamed; lanes ready in {warming.seconds:.2f} s ({warming.lane_seconds}); "
          f"16 sessions equal their solo runs; counters {c}")


def test_sessions_from_many_threads_on_one_lane_that_draws_are_exact():
    """The control of the test above: eight seeded drawing sessions from eight threads, all on lane 0 of a
    one-lane program captured before traffic."""
    pin_envelope()
    eps, prog = _noisy(depth=48, lanes=1)
    prog.warmup()
    xs = [torch.randn(1, 4, 64, device="cuda") for _ in range(24)]
    want = {s: _noisy_solo(eps, xs, s) for s in range(8)}
    got = _noisy_streams(prog, xs, range(8))
    assert got == want, sorted(s for s in want if got.get(s) != want[s])
