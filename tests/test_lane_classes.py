"""``warmup(full_lanes=k)``: lanes from k on capture only the steady catalog classes, and a call is only
ever handed a lane that has its class, so nothing is captured or run eagerly during traffic and every
stream keeps its bytes."""

from __future__ import annotations

import threading

import pytest
import torch

import cadence_fx as cf
from cadence_fx.runtime.lanes import NoLaneToPin
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_catalog, sha256

CFG = DemoConfig()


@pytest.fixture(scope="module")
def setup():
    return demo_catalog(CFG)


def _example(model):
    x = torch.zeros(1, CFG.chunk, CFG.dim)
    return (x, *model.initial_state(), x)


def _conversation(session, model, i: int, calls: int) -> str:
    state = [s + 0.01 * i for s in model.initial_state()]
    outs = []
    for k in range(calls):
        g = torch.Generator().manual_seed(100 * i + k)
        o = session(torch.randn(1, CFG.chunk, CFG.dim, generator=g), *state, torch.randn(1, CFG.chunk, CFG.dim, generator=g))
        outs += [t.clone() for t in o]
        state = list(o[1:])
    return sha256(outs)


def _replays(prog) -> list[int]:
    return [lane.runners.counters()["replays"] for lane in prog.lanes.lanes]


def test_lanes_past_full_lanes_capture_only_the_steady_class(setup):
    model, contract, eps = setup
    assert len(eps) >= 2, "the demo catalog needs a transient class for this test"
    full = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3)
    full.warmup(*_example(model))
    part = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3)
    part.warmup(*_example(model), full_lanes=1)
    keys = list(part.lanes.lanes[0].catalog)
    assert part.lanes.lanes[0].classes is None
    assert [ln.classes for ln in part.lanes.lanes[1:]] == [frozenset({keys[-1]})] * 2
    per_lane = full.counters()["captures"] // 3
    assert part.counters()["captures"] < full.counters()["captures"]
    assert part.counters()["captures"] > per_lane  # lane 0 whole, and the steady class on lanes 1 and 2
    # the first class of every catalog position can be named from the end or the start
    steady0 = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2)
    steady0.warmup(*_example(model), full_lanes=1, steady=(0,))
    assert steady0.lanes.lanes[1].classes == frozenset({keys[0]})
    with pytest.raises(ValueError, match="steady=.*class"):
        cf.optimize(eps, contract, replay=FakeBackend(), lanes=2).warmup(*_example(model), full_lanes=1,
                                                                        steady=(len(keys),))


def test_a_transient_class_waits_for_a_lane_that_has_it_and_every_stream_keeps_its_bytes(setup):
    """Lane 0 is held by this thread: a conversation's first call (a transient class) cannot run on
    lanes 1-2, which lack it, so it waits and then runs on lane 0; once past the transient classes the
    conversations replay on lanes 1-2 too. Nothing is captured or run eagerly during traffic, and every
    conversation equals its run on a program of one lane."""
    model, contract, eps = setup
    one = cf.optimize(eps, contract, replay=FakeBackend(), lanes=1)
    one.warmup(*_example(model))
    want = [_conversation(one.session(f"w{i}"), model, i, calls=len(eps) + 2) for i in range(3)]

    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3)
    prog.warmup(*_example(model), full_lanes=1)
    captures = prog.counters()["captures"]
    got: dict[int, str] = {}
    first = threading.Thread(target=lambda: got.__setitem__(0, _conversation(prog.session("a"), model, 0, calls=1)))
    with prog.lanes.take(0):
        before = _replays(prog)
        first.start()
        first.join(timeout=0.5)
        assert first.is_alive(), "a transient class ran on a lane without it"
        assert _replays(prog) == before
    first.join(timeout=60)
    after = _replays(prog)
    assert after[0] > before[0] and after[1:] == before[1:]

    sessions = [prog.session(f"s{i}") for i in range(3)]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _conversation(sessions[i], model, i,
                                                                                      calls=len(eps) + 2)))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(3)] == want
    c = prog.counters()
    assert c["eager"] == 0 and c["captures"] == captures, c


def test_a_session_is_pinned_only_to_a_lane_with_every_class(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3)
    prog.warmup(*_example(model), full_lanes=2)
    assert prog.lanes.lanes[1].classes is None and prog.lanes.lanes[2].classes is not None
    pinned = prog.session("p", pin=True)
    assert pinned.lane.index == 1
    with pytest.raises(NoLaneToPin):
        prog.session("q", pin=True)
