"""Many conversations through one program: isolated state, shared weights and graphs, exact bytes."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_call, demo_catalog, demo_inputs, live_view, sha256

CFG = DemoConfig()
LIVE = {2: {0: CFG.steps}}


@pytest.fixture(scope="module")
def setup():
    return demo_catalog(CFG)


def _fresh(seed: int, k: int):
    return demo_inputs(CFG, seed, k)


def _call(fn, seed, k, state):
    return demo_call(fn, CFG, seed, k, state)


def _solo(eps, state0, seed, calls):
    """The conversation alone through the unmodified programs: every call's outputs (live view)."""
    ref = cf.reference(eps)
    state, outs = [s.clone() for s in state0], []
    for k in range(calls):
        o = _call(ref, seed, k, state)
        outs.append([t.clone() for t in live_view(o, LIVE)])
        state = [t.clone() for t in o[1:]]
    return outs


def _prompt_state(model, seed):
    return [s + seed * 0.01 for s in model.initial_state()]  # a different prompt per conversation


def test_two_sessions_interleaved_are_each_their_own_solo_run(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2)
    prog.warmup(*_fresh(0, 0)[:1], *model.initial_state(), _fresh(0, 0)[1])
    a, b = prog.session("a"), prog.session("b")
    sa, sb = _prompt_state(model, 1), _prompt_state(model, 2)
    got = {1: [], 2: []}
    for k in range(6):
        for seed, s in ((1, a), (2, b)):
            state = sa if seed == 1 else sb
            o = _call(s, seed, k, state)
            got[seed].append([t.clone() for t in o])
            if seed == 1:
                sa = list(o[1:])
            else:
                sb = list(o[1:])
    for seed in (1, 2):
        ref = _solo(eps, _prompt_state(model, seed), seed, 6)
        assert sha256([t for o in ref for t in o]) == sha256([t for o in got[seed] for t in o]), f"session {seed}"
    c = prog.counters()
    assert c["eager"] == 0 and c["replays"] == 2 * 2 * 6  # every call replayed, on one lane or the other
    assert a.nbytes() == b.nbytes() == sum(rp.session_bytes for rp in prog.plan.regions)


def test_state_of_another_session_is_copied_and_an_older_view_refused(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    a, b = prog.session("a"), prog.session("b")
    sa = list(_call(a, 1, 0, _prompt_state(model, 1))[1:])
    older = sa
    sa = list(_call(a, 1, 1, sa)[1:])
    # b starts from a's current state: copied in, exactly what the stock program computes from it
    ob = _call(b, 5, 0, sa)
    ref = cf.reference(eps)
    r = _prompt_state(model, 1)
    for k in range(2):
        r = [t.clone() for t in _call(ref, 1, k, r)[1:]]
    expect = _call(ref, 5, 0, r)
    assert all(torch.equal(x, y) for x, y in zip(live_view(expect, LIVE), ob))
    with pytest.raises(cf.StaleState, match="region 'encoder_kv'"):
        _call(b, 5, 1, older)  # a view of a's buffers from an older call
    with pytest.raises(cf.StaleState):
        _call(a, 1, 2, older)
    # the default session's state passed to a session is copied too
    d = list(_call(prog, 3, 0, _prompt_state(model, 3))[1:])
    ob2 = _call(b, 4, 0, d)
    expect2 = _call(ref, 4, 0, [t.clone() for t in _call(ref, 3, 0, _prompt_state(model, 3))[1:]])
    assert all(torch.equal(x, y) for x, y in zip(live_view(expect2, LIVE), ob2))


def test_default_session_survives_a_session_on_its_lane(setup):
    """Plain calls keep their state in lane 0; a session that runs there copies it out first."""
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    s = prog.session()
    state, s_state = _prompt_state(model, 7), _prompt_state(model, 8)
    outs, s_outs = [], []
    for k in range(5):
        o = _call(prog, 7, k, state)
        outs.append([t.clone() for t in o])
        state = list(o[1:])
        so = _call(s, 8, k, s_state)  # lane 0 is the only lane: the default state is copied out first
        s_outs.append([t.clone() for t in so])
        s_state = list(so[1:])
    for seed, got in ((7, outs), (8, s_outs)):
        ref = _solo(eps, _prompt_state(model, seed), seed, 5)
        assert sha256([t for o in ref for t in o]) == sha256([t for o in got for t in o]), seed


def test_snapshot_restore_and_close(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    s = prog.session("turns")
    state = _prompt_state(model, 2)
    for k in range(3):
        state = list(_call(s, 2, k, state)[1:])
    snap = s.snapshot()
    after = [[t.clone() for t in _call(s, 2, 3, state)]]
    state = s.restore(snap)  # barge-in: rewind to the turn boundary and take the same turn again
    again = _call(s, 2, 3, [state[r.name] for r in contract.regions])
    assert all(torch.equal(x, y) for x, y in zip(after[0], again))
    before, held = prog.memory_census()["sessions"], s.nbytes()
    s.close()
    assert held > 0 and prog.memory_census()["sessions"] == before - held and s.nbytes() == 0
    with pytest.raises(cf.SessionClosed):
        _call(s, 2, 4, state)


class Noisy(torch.nn.Module):
    """A step that draws device randomness every call (like HiFT's sine source) and carries a cache."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        kv = torch.cat([cache, x], 1)
        return self.lin(kv.mean(1) + torch.randn_like(x[:, 0])), kv[:, -3:]


def test_each_session_draws_its_own_random_stream():
    contract = cf.Contract(clocks=(cf.Clock("frame", 1),), wrap=("lin",), regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(3), initial=3),))
    step = Noisy().eval()
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(1, 1, 4), "cache": torch.zeros(1, 3, 4)})
    prog = cf.optimize(eps, contract, replay="off")
    xs = [torch.randn(1, 1, 4) for _ in range(4)]

    def solo(seed):
        torch.manual_seed(seed)
        ref, c, out = cf.reference(eps), torch.zeros(1, 3, 4), []
        for x in xs:
            y, c = ref(x, c)
            out.append(y.clone())
        return out

    want = {1: solo(1), 2: solo(2)}
    sessions = {1: prog.session(seed=1), 2: prog.session(seed=2)}
    caches = {1: torch.zeros(1, 3, 4), 2: torch.zeros(1, 3, 4)}
    got = {1: [], 2: []}
    torch.manual_seed(99)  # the process's own stream is not the sessions'
    for x in xs:
        for i in (2, 1):
            y, caches[i] = sessions[i](x, caches[i])
            got[i].append(y.clone())
    for i in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(want[i], got[i])), f"session {i}"


class _Attend(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, kv, live):
        q = self.proj(kv)[:, None]
        att = torch.nn.functional.scaled_dot_product_attention(q, q, q)  # dropout_p 0
        noise = torch.rand_like(kv[:, 0]) if live else 0.0
        return self.drop(att[:, 0]).mean(1) + noise


class EvalDropout(torch.nn.Module):
    """Attention with an eval-mode dropout: seeded ops in the exported graph that draw nothing."""

    def __init__(self, live: bool):
        super().__init__()
        self.lin = _Attend()
        self.live = live

    def forward(self, x, cache):
        kv = torch.cat([cache, x], 1)
        return self.lin(kv, self.live), kv[:, -3:]


@pytest.mark.parametrize("live", [False, True], ids=["inert", "draws"])
def test_only_partitions_that_draw_are_marked_random(live):
    """An eval-mode dropout and an attention without dropout draw nothing: their partition is not
    marked random (its replays run outside the session streams and are never ordered across lanes);
    one ``rand_like`` beside them is a draw."""
    contract = cf.Contract(clocks=(cf.Clock("frame", 1),), wrap=("lin",), regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(3), initial=3),))
    step = EvalDropout(live).eval()
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(1, 1, 4), "cache": torch.zeros(1, 3, 4)})
    seeded = {str(n.target) for ep in eps for n in ep.graph_module.graph.nodes
              if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())}
    assert {"aten.dropout.default", "aten.scaled_dot_product_attention.default"} <= seeded, seeded
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    assert prog.stats["passes"].get("mark_randomness", 0) == int(live)
    x = torch.randn(1, 1, 4)
    torch.manual_seed(3)
    want = cf.reference(eps)(x, torch.zeros(1, 3, 4))[0]
    torch.manual_seed(3)
    assert torch.equal(prog(x, torch.zeros(1, 3, 4))[0], want)
    # the counters name the callables whose replays draw, and why
    assert prog.counters()["drawing"] == ({"declared": ["L__self__lin"]} if live else {})


def test_one_sessions_bytes_are_the_same_alone_interleaved_and_concurrent(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=3)
    prog.warmup(*_fresh(0, 0)[:1], *model.initial_state(), _fresh(0, 0)[1])

    def run(session, seed, calls=5):
        state, outs = _prompt_state(model, seed), []
        for k in range(calls):
            o = _call(session, seed, k, state)
            outs.append([t.clone() for t in o])
            state = list(o[1:])
        return sha256([t for o in outs for t in o])

    alone = run(prog.session(), 11)
    digests = {}
    threads = [threading.Thread(target=lambda s=s: digests.__setitem__(s, run(prog.session(), s))) for s in (11, 12, 13, 14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert digests[11] == alone
    solo = _solo(eps, _prompt_state(model, 12), 12, 5)
    assert digests[12] == sha256([t for o in solo for t in o])


@st.composite
def schedules(draw):
    k = draw(st.integers(2, 4))
    ops = draw(st.lists(st.tuples(st.sampled_from(["call", "call", "call", "snapshot", "restore", "close", "join"]),
                                  st.integers(0, k - 1)), min_size=4, max_size=24))
    return k, draw(st.integers(0, 2)), ops


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], phases=[Phase.explicit, Phase.generate])
@given(schedules())
def test_random_session_schedules_match_each_session_run_alone(setup, case):
    """Join, leave, interleave, snapshot/restore: each session's every output equals that session
    run alone through ep.module() (restores included), whatever ran beside it."""
    model, contract, eps = setup
    k, lanes, ops = case
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=lanes + 1)
    ref = cf.reference(eps)
    live = {}  # slot -> dict(session, seed, step, state, ref_state, snap)
    joined = 0

    def join(slot):
        nonlocal joined
        joined += 1
        seed = 100 + joined
        st0 = _prompt_state(model, seed)
        live[slot] = dict(s=prog.session(f"s{joined}"), seed=seed, step=0, state=st0,
                          ref=[t.clone() for t in st0], snap=None)

    for slot in range(k):
        join(slot)
    for op, slot in ops:
        if slot not in live:
            if op == "join":
                join(slot)
            continue
        c = live[slot]
        if op == "call":
            o = _call(c["s"], c["seed"], c["step"], c["state"])
            r = _call(ref, c["seed"], c["step"], c["ref"])
            assert all(torch.equal(x, y) for x, y in zip(live_view(r, LIVE), o)), (op, slot, c["step"])
            c["state"], c["ref"], c["step"] = list(o[1:]), [t.clone() for t in r[1:]], c["step"] + 1
        elif op == "snapshot" and c["step"] > 0:  # a turn boundary after at least one call
            c["snap"] = (c["s"].snapshot(), [t.clone() for t in c["ref"]], c["step"])
        elif op == "restore" and c["snap"] is not None:
            snap, ref_state, step = c["snap"]
            restored = c["s"].restore(snap)
            c["state"] = [restored[r.name] for r in contract.regions]
            c["ref"], c["step"] = [t.clone() for t in ref_state], step
        elif op == "close":
            c["s"].close()
            del live[slot]
        elif op == "join":
            c["s"].close()
            join(slot)


class Scratch(torch.nn.Module):
    """Writes a module buffer in place every call and returns a view of it (stock scratch, not state)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("work", torch.zeros(4, 4))

    def forward(self, x, cache):
        kv = torch.cat([cache, x], 0)
        self.work.copy_(kv[-4:] * 2)
        return self.work[:2], kv[-3:]


@pytest.mark.parametrize("lanes", [1, 2])
def test_an_output_viewing_what_a_lane_writes_is_the_sessions_own(lanes):
    contract = cf.Contract(clocks=(cf.Clock("frame", 1),), regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=0, order="old_new",
                  retention=cf.SlidingWindow(3), initial=3),))
    eps = cf.export_catalog(Scratch(), contract, {"x": torch.zeros(1, 4), "cache": torch.zeros(3, 4)})
    prog = cf.optimize(eps, contract, replay="off", lanes=lanes)
    a, b = prog.session("a"), prog.session("b")
    ya, _ = a(torch.ones(1, 4), torch.zeros(3, 4))
    kept = ya.clone()
    b(torch.full((1, 4), 7.0), torch.full((3, 4), 5.0))  # the same lane (or the other) writes its scratch
    assert torch.equal(ya, kept)


def test_a_wrong_state_is_refused_after_the_views_geometry_is_kept(setup):
    """A session call keeps each checked view geometry on the region site; a state of another dtype or
    shape is refused all the same (by the catalog or the state check), and the session goes on with
    its solo bytes."""
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    a = prog.session("a")
    state = _prompt_state(model, 1)
    outs = []
    for k in range(2):  # the second call takes its views from the kept geometry
        o = _call(a, 1, k, state)
        outs.append([t.clone() for t in o])
        state = list(o[1:])
    assert any(site.geometry for site in prog.region_sites().values())
    for bad in (state[0].to(torch.float64), state[0][..., :1]):
        with pytest.raises((cf.StateMismatch, cf.CatalogMiss)):
            _call(a, 1, 2, [bad, *state[1:]])
    o = _call(a, 1, 2, state)
    outs.append([t.clone() for t in o])
    ref = _solo(eps, _prompt_state(model, 1), 1, 3)
    assert sha256([t for r in ref for t in r]) == sha256([t for r in outs for t in r])
