"""Pinned sessions: a conversation's state stays in its own lane's buffers; a call copies no state,
its undo saves only what the call overwrites (the journal), and every stream stays exact."""

from __future__ import annotations

import threading

import pytest
import torch

import cadence_fx as cf
from cadence_fx.runtime import transaction
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_call, demo_catalog, demo_inputs, live_view, sha256
from tests.test_transactions import Fault, _fault_every_op

CFG = DemoConfig()
LIVE = {2: {0: CFG.steps}}


@pytest.fixture(scope="module")
def setup():
    return demo_catalog(CFG)


def _call(fn, seed, k, state):
    return demo_call(fn, CFG, seed, k, state)


def _prompt_state(model, seed):
    return [s + seed * 0.01 for s in model.initial_state()]


def _solo(eps, model, seed, calls):
    ref = cf.reference(eps)
    state, outs = _prompt_state(model, seed), []
    for k in range(calls):
        o = _call(ref, seed, k, state)
        outs.append([t.clone() for t in live_view(o, LIVE)])
        state = [t.clone() for t in o[1:]]
    return sha256([t for o in outs for t in o])


def _stream(session, model, seed, calls, ptrs=None):
    state, outs = _prompt_state(model, seed), []
    for k in range(calls):
        o = _call(session, seed, k, state)
        outs.append([t.clone() for t in live_view(o, LIVE)])
        state = list(o[1:])
        if ptrs is not None:
            ptrs.append([t.untyped_storage().data_ptr() for t in state])
    return sha256([t for o in outs for t in o])


@pytest.mark.parametrize("journal", [False, True])
@pytest.mark.parametrize("replay", ["fake", "off"])
def test_pinned_and_shared_sessions_interleaved_are_each_their_own_solo_run(setup, replay, journal):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend() if replay == "fake" else "off", lanes=3, journal=journal)
    a, b = prog.session("a", pin=True), prog.session("b", pin=True)
    c = prog.session("c")  # not pinned: lane 0 is the only lane left to it
    assert {a.lane.index, b.lane.index} == {1, 2} and c.lane is None
    states = {s: _prompt_state(model, seed) for s, seed in ((a, 1), (b, 2), (c, 3), (prog, 4))}
    outs: dict = {s: [] for s in states}
    ptrs: dict = {a: [], b: []}
    for k in range(6):
        for s, seed in ((a, 1), (c, 3), (prog, 4), (b, 2)):
            o = _call(s, seed, k, states[s])
            outs[s].append([t.clone() for t in live_view(o, LIVE)])
            states[s] = list(o[1:])
            if s in ptrs:
                ptrs[s].append({t.untyped_storage().data_ptr() for t in states[s]})
    for s, seed in ((a, 1), (b, 2), (c, 3), (prog, 4)):
        assert sha256([t for o in outs[s] for t in o]) == _solo(eps, model, seed, 6), f"conversation {seed}"
    for s in (a, b):  # the state lives in the pinned lane's own buffers, call after call
        lane_bufs = {t.untyped_storage().data_ptr() for t in s.lane.state.region_buffers.values()}
        assert all(p == ptrs[s][0] and p <= lane_bufs for p in ptrs[s])
        assert s.nbytes() == sum(t.untyped_storage().nbytes() for t in s.lane.state.region_buffers.values())


def test_a_pinned_call_copies_no_state_and_saves_less_than_its_state(setup, monkeypatch):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2, journal=True)
    s = prog.session("p", pin=True)
    copies, saved = [], []
    real_copy, real_undo = cf.runtime.sessions.copy_states, transaction.CallUndo.__init__

    def count_copies(dsts, srcs):
        copies.append(sum(d.numel() * d.element_size() for d in dsts))
        return real_copy(dsts, srcs)

    def count_undo(self, gm, journal, views):
        real_undo(self, gm, journal, views)
        saved.append((self._log.nbytes(), self.nbytes()))

    monkeypatch.setattr(cf.runtime.sessions, "copy_states", count_copies)
    monkeypatch.setattr(transaction.CallUndo, "__init__", count_undo)
    state = _prompt_state(model, 1)
    live = []
    for k in range(5):
        o = _call(s, 1, k, state)
        state = list(o[1:])
        live.append(sum(t.numel() * t.element_size() for t in state))
    assert copies[0] > 0 and copies[1:] == [0] * 4  # the prompt state is copied in once, then nothing
    # each later call copies whole (a host operation per region) less than the state it starts from; the
    # journal, inside the graphs, saves the rest: never more than twice the state (journal_writes)
    assert all(whole < before and 0 < total <= whole + 2 * before
               for (whole, total), before in zip(saved[1:], live))


@pytest.mark.parametrize("journal", [False, True])
@pytest.mark.parametrize("exc", [Fault, KeyboardInterrupt])
@pytest.mark.parametrize("replay", ["fake", "off"])
def test_a_fault_at_any_op_of_a_pinned_call_is_undone_and_the_retry_is_exact(setup, replay, exc, journal):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend() if replay == "fake" else "off", lanes=2, journal=journal)
    # every op for one configuration, a stride elsewhere (the suite's time), as in test_transactions
    stride = 1 if (replay, exc, journal) == ("fake", Fault, True) else 5
    fired, checked = _fault_every_op(model, eps, prog.session("p", pin=True), stride=stride, exc=exc)
    assert fired > 20 and checked == 3


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("replay", ["fake", "off"])
def test_a_fault_at_any_op_of_a_default_call_with_the_journal_is_undone(setup, replay, lanes):
    """The default program keeps its state in lane 0: with the journal, its undo puts back what each
    write overwrote (the regions it cannot journal are copied whole)."""
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend() if replay == "fake" else "off", lanes=lanes, journal=True)
    assert any(e.facts.journal.entries for e in prog.lanes.lanes[0].catalog.values())
    fired, checked = _fault_every_op(model, eps, prog, stride=1 if (replay, lanes) == ("fake", 2) else 5)
    assert fired > 20 and checked == 3


def test_without_the_journal_no_graph_holds_one(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off", lanes=2)
    assert all(e.facts.journal is None for ln in prog.lanes.lanes for e in ln.catalog.values())
    assert prog.memory_census()["journal"] == 0


def test_pinning_is_refused_once_lanes_run_out_and_close_gives_the_lane_back(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off", lanes=2)
    a = prog.session("a", pin=True)
    with pytest.raises(cf.NoLaneToPin, match="no lane to pin"):
        prog.session("b", pin=True)
    one = cf.optimize(eps, contract, replay="off", lanes=1)
    with pytest.raises(cf.NoLaneToPin):
        one.session("x", pin=True)
    lane = a.lane
    a.close()
    b = prog.session("b", pin=True)
    assert b.lane is lane
    assert _stream(b, model, 5, 3) == _solo(eps, model, 5, 3)  # nothing of a's state is left to b
    with pytest.raises(cf.SessionClosed):
        _call(a, 1, 0, _prompt_state(model, 1))


def test_a_pinned_sessions_state_is_refused_by_another_session(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off", lanes=3)
    a, b = prog.session("a", pin=True), prog.session("b", pin=True)
    o = _call(a, 1, 0, _prompt_state(model, 1))
    _call(a, 1, 1, list(o[1:]))  # a's first state is now older than its last call
    with pytest.raises(cf.StaleState):
        _call(b, 1, 1, list(o[1:]))


def test_a_pinned_session_snapshot_restore_replays_exactly(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2, journal=True)
    s = prog.session("p", pin=True)
    state = _prompt_state(model, 1)
    for k in range(2):
        state = list(_call(s, 1, k, state)[1:])
    snap = s.snapshot()
    first = [t.clone() for t in live_view(_call(s, 1, 2, state), LIVE)]
    restored = s.restore(snap)
    again = live_view(_call(s, 1, 2, [restored[r.name] for r in contract.regions]), LIVE)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_pinned_sessions_on_threads_are_each_exact(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=4, journal=True)
    digests = {}
    sessions = {seed: prog.session(f"t{seed}", pin=seed < 13) for seed in (11, 12, 13, 14)}
    threads = [threading.Thread(target=lambda seed=seed: digests.__setitem__(seed, _stream(sessions[seed], model,
                                                                                           seed, 5)))
               for seed in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in sessions:
        assert digests[seed] == _solo(eps, model, seed, 5), f"session {seed}"
