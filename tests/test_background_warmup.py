"""Lanes captured beside traffic (``warmup_in_background``, ``WorkerConfig.serve_from_lanes``): the first
lanes serve while the others capture; a lane still capturing is never handed to a call; each stream is
bit for bit its solo run through the unmodified exported programs, before, during and after; a capture
that fails leaves its lane offline and the others serving. The CUDA test is in test_sessions_cuda.py."""

from __future__ import annotations

import threading

import pytest
import torch

import cadence_fx as cf
from cadence_fx.runtime import sessions as sessions_mod
from cadence_fx.runtime import warmup as warmup_mod
from cadence_fx.testing.demo_model import DemoConfig
from tests.helpers import demo_call, demo_catalog, demo_inputs, live_view, sha256

CFG = DemoConfig(dim=32, chunk=4, prompt=12, head=12, tail=8, steps=2, slots=4, capacity=64)
CALLS = 5
LIVE = {2: {0: CFG.steps}}  # the reference returns the whole cat, the program the live part


@pytest.fixture(scope="module")
def demo():
    model, contract, eps = demo_catalog(CFG)
    return model, contract, eps


def _state(model, seed):
    return [s + seed * 0.01 for s in model.initial_state()]


def _stream(fn, model, seed, calls=CALLS, *, clone_state=False):
    state, outs = _state(model, seed), []
    for k in range(calls):
        o = demo_call(fn, CFG, seed, k, state)
        outs.append([t.clone() for t in live_view(o, LIVE)])
        state = [t.clone() for t in o[1:]] if clone_state else list(o[1:])
    return sha256([t for o in outs for t in o])


class _Gate:
    """Holds the background warm-up of each lane until released (and can make one raise)."""

    def __init__(self, monkeypatch, fail_lane: int | None = None) -> None:
        self.release = threading.Event()
        real = warmup_mod.warm_lane

        def held(lanes, lane, *a, beside=False, **kw):
            if beside:
                assert self.release.wait(30)
                if lane.index == fail_lane:
                    raise RuntimeError(f"injected: lane {lane.index} cannot capture")
            return real(lanes, lane, *a, beside=beside, **kw)

        monkeypatch.setattr(warmup_mod, "warm_lane", held)


def _lanes_used(monkeypatch) -> list[int]:
    used: list[int] = []
    real = sessions_mod.Session._run_on

    def spy(self, lane, *a, **kw):
        used.append(lane.index)
        return real(self, lane, *a, **kw)

    monkeypatch.setattr(sessions_mod.Session, "_run_on", spy)
    return used


def _concurrent(prog, model, seeds) -> dict[int, str]:
    held = {s: prog.session(f"s{s}", seed=s) for s in seeds}
    got: dict[int, str] = {}

    def run(s):
        got[s] = _stream(held[s], model, s)

    threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in held.values():
        h.close()
    return got


def test_the_first_lane_serves_while_the_others_capture_and_every_stream_is_exact(demo, monkeypatch):
    model, contract, eps = demo
    ref = cf.reference(eps)
    solo = {s: _stream(ref, model, s, clone_state=True) for s in range(4)}
    prog = cf.optimize(eps, contract, lanes=3)
    gate = _Gate(monkeypatch)
    used = _lanes_used(monkeypatch)
    tok, noise = demo_inputs(CFG, 0, 0)
    warming = prog.warmup_in_background(tok, *_state(model, 0), noise, first=1)
    assert prog.lanes.online() == 1 and not warming.done
    during = _concurrent(prog, model, [0, 1])
    assert during == {0: solo[0], 1: solo[1]}
    assert set(used) == {0}, used  # the lanes still capturing were handed to no call
    with pytest.raises(TimeoutError, match="1 of 3 online"):
        warming.wait(0.05)
    gate.release.set()
    warming.wait(30)
    assert warming.error is None and prog.lanes.online() == 3 and sorted(warming.lane_seconds) == [1, 2]
    used.clear()
    with prog.lanes.take(0):  # lane 0 held here: the calls can only go to the lanes captured late
        after = _concurrent(prog, model, [0, 1, 2, 3])
    assert after == solo
    assert used and set(used) <= {1, 2}, used  # the captured lanes serve now


def test_a_lane_whose_capture_fails_stays_offline_and_the_others_serve(demo, monkeypatch, caplog):
    model, contract, eps = demo
    ref = cf.reference(eps)
    solo = {s: _stream(ref, model, s, clone_state=True) for s in range(3)}
    prog = cf.optimize(eps, contract, lanes=3)
    gate = _Gate(monkeypatch, fail_lane=2)
    used = _lanes_used(monkeypatch)
    tok, noise = demo_inputs(CFG, 0, 0)
    warming = prog.warmup_in_background(tok, *_state(model, 0), noise, first=1)
    gate.release.set()
    with pytest.raises(RuntimeError, match="2 of 3 lanes online.*injected: lane 2"):
        warming.wait(30)
    assert prog.lanes.online() == 2 and "stay offline" in caplog.text
    assert _concurrent(prog, model, [0, 1, 2]) == solo
    assert 2 not in used


def test_first_must_name_lanes_the_program_has(demo):
    model, contract, eps = demo
    prog = cf.optimize(eps, contract, lanes=2)
    tok, noise = demo_inputs(CFG, 0, 0)
    for first in (0, 3):
        with pytest.raises(ValueError, match="first must be in 1..2"):
            prog.warmup_in_background(tok, *_state(model, 0), noise, first=first)
    assert prog.lanes.online() == 2


# --------------------------------------------------------------------------- the worker
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def artifact(demo, tmp_path_factory):
    _model, contract, eps = demo
    path = tmp_path_factory.mktemp("bg") / "demo.cfx"
    info = cf.save(cf.optimize(eps, contract, replay="off"), path)
    return str(path), info["sha256"]


def test_a_worker_serving_from_its_first_lane_admits_in_proportion_and_grows(artifact, monkeypatch):
    from cadence_fx.serve.conversation import AdmissionRefused
    from cadence_fx.serve.worker import ConversationWorker, WorkerConfig

    path, digest = artifact
    base = dict(sha256=digest, lanes=4, replay="off", threads=1)
    with pytest.raises(ValueError, match="needs capacity given"):
        ConversationWorker(WorkerConfig(path, serve_from_lanes=1, **base))
    gate = _Gate(monkeypatch)
    w = ConversationWorker(WorkerConfig(path, serve_from_lanes=1, capacity=8, **base))
    st = w.status()
    assert (st.lanes, st.lanes_online, st.capacity, st.capacity_full) == (4, 1, 2, 8)
    assert st.lanes_ready_s is None and st.warmup_error is None
    w.open("a", seed=1)
    w.open("b", seed=2)
    with pytest.raises(AdmissionRefused, match="at capacity: 2 of 2"):
        w.open("c", seed=3)
    with pytest.raises(TimeoutError):
        w.wait_lanes(0.05)
    gate.release.set()
    st = w.wait_lanes(30)
    assert (st.lanes_online, st.capacity) == (4, 8) and st.lanes_ready_s is not None and st.lanes_ready_s >= st.ready_s
    w.open("c", seed=3)
    # the old mode: every lane before ready, and lanes_ready_s is ready_s
    plain = ConversationWorker(WorkerConfig(path, capacity=8, **base))
    st = plain.status()
    assert (st.lanes_online, st.capacity) == (4, 8) and st.lanes_ready_s == st.ready_s


def test_the_draws_lock_counts_its_outermost_holds():
    from cadence_fx.runtime import rng

    rng.draw_lock_stats(reset=True)
    with rng.draws_held():
        with rng.draws_held():  # re-entered by its holder (a capture inside a class held whole): one hold
            pass
    session = rng.SessionRng(rng.RngStates.seeded(3))
    with rng.session_rng(session), rng.drawing():
        torch.rand(2)
    got = rng.draw_lock_stats()
    assert got["acquired"] == 2 and got["held_s"] >= 0 and got["wait_s"] >= 0
    assert rng.draw_lock_stats(reset=True)["acquired"] == 2 and rng.draw_lock_stats()["acquired"] == 0
