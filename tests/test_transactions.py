"""A call that fails half-way keeps the conversation: state, random streams and views intact.

Faults are injected at every operator a call runs (a dispatch mode that raises at the k-th op):
the copy-in, the rewritten graph, the session's commit. After each fault the retry, fed the state
the last good call returned, must give the unmodified program's bytes.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_call, demo_catalog, demo_inputs, live_view

CFG = DemoConfig()
LIVE = {2: {0: CFG.steps}}


class Fault(Exception):
    """The injected failure."""


class FaultAt(TorchDispatchMode):
    """Raise ``exc`` at the ``k``-th operator run inside the block (once); counts operators."""

    def __init__(self, k: int, exc: type[BaseException] = Fault) -> None:
        super().__init__()
        self.k, self.exc, self.n = k, exc, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if self.n == self.k:
            raise self.exc(f"injected at op {self.n}: {func}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def setup():
    return demo_catalog(CFG)


def _inputs(seed: int, k: int):
    return demo_inputs(CFG, seed, k)


def _call(fn, seed, k, state):
    return demo_call(fn, CFG, seed, k, state)


def _same(ref, opt) -> bool:
    return all(torch.equal(a, b) for a, b in zip(live_view(ref, LIVE), opt))


def _ops_per_call(fn, state) -> int:
    probe = FaultAt(0)
    with probe:
        fn(*_inputs(0, 0)[:1], *[s.clone() for s in state], _inputs(0, 0)[1])
    return probe.n


def _fault_every_op(model, eps, fn, *, stride: int, exc=Fault, calls: int = 3) -> tuple[int, int]:
    """Calls of ``fn`` with a fault before each good one, at every ``stride``-th operator of the call
    in turn; returns (faults that fired, good calls checked). Every good call must equal the
    reference from the same state, and the retry must accept the last returned state as it is."""
    ref = cf.reference(eps)
    state = list(model.initial_state())
    ref_state = [s.clone() for s in state]
    ops = _ops_per_call(fn, state)  # a first call (its state copied in): the most operators a call runs
    fired = checked = 0
    for k in range(calls):
        for at in range(1, ops + 1, stride):
            kept = [t.clone() for t in state]  # the bytes the failed call must leave
            try:
                with FaultAt(at, exc):
                    out = _call(fn, 1, k, state)
            except exc:
                fired += 1
                assert all(torch.equal(a, b) for a, b in zip(state, kept)), f"call {k}, fault at op {at}"
                continue
            # the fault index is past this call's operators: the call went through
            r = _call(ref, 1, k, ref_state)
            assert _same(r, out), f"call {k}: fault index {at} past the call"
            state, ref_state = list(out[1:]), [t.clone() for t in r[1:]]
            break
        else:
            out = _call(fn, 1, k, state)  # the retry after the last fault: fed the same views
            r = _call(ref, 1, k, ref_state)
            assert _same(r, out), f"call {k}: retry after faults"
            state, ref_state = list(out[1:]), [t.clone() for t in r[1:]]
        checked += 1
    return fired, checked


@pytest.mark.parametrize("replay", ["fake", "off"])
@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("who", ["default", "session"])
def test_a_fault_at_any_op_leaves_the_state_and_the_retry_is_exact(setup, who, lanes, replay):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend() if replay == "fake" else "off", lanes=lanes)
    fn = prog if who == "default" else prog.session("s")
    # every op for one configuration, a stride elsewhere (the suite's time): the ops differ by config
    # only in the runtime's own copies, which every stride still reaches on some call
    stride = 1 if (who, lanes, replay) == ("session", 2, "fake") else 5
    fired, checked = _fault_every_op(model, eps, fn, stride=stride)
    assert fired > 20 and checked == 3


@pytest.mark.parametrize("who", ["default", "session"])
def test_a_keyboard_interrupt_inside_a_call_is_undone(setup, who):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2)
    fn = prog if who == "default" else prog.session("s")
    fired, checked = _fault_every_op(model, eps, fn, stride=17, exc=KeyboardInterrupt, calls=2)
    assert fired > 5 and checked == 2


class Embed(torch.nn.Module):
    """Token ids through an embedding into a window cache: an out-of-range id fails inside the call,
    after the cache has been written in place."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, ids, cache):
        kv = torch.cat([cache, self.lin(x)], 1)
        return kv.sum(1) + self.emb(ids).sum(1), kv[:, -3:]


def test_an_out_of_range_token_id_leaves_the_window_intact():
    torch.manual_seed(0)
    contract = cf.Contract(clocks=(cf.Clock("frame", 1),), wrap=(cf.WHOLE_STEP,), regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(3), initial=3),))
    step = Embed().eval()
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(1, 1, 4), "ids": torch.zeros(1, 2, dtype=torch.long),
                                             "cache": torch.zeros(1, 3, 4)})
    ref = cf.reference(eps)
    for prog in (cf.optimize(eps, contract, replay="off"), cf.optimize(eps, contract, replay="off").session()):
        c = r = torch.randn(1, 3, 4)
        for k in range(4):
            x, ids = torch.randn(1, 1, 4), torch.tensor([[k, 9]])
            kept = c.clone()
            with pytest.raises(IndexError):
                prog(x, torch.tensor([[k, 10]]), c)  # one bad id of a client's chunk
            assert torch.equal(c, kept)
            y, c = prog(x, ids, c)
            y_ref, r = ref(x, ids, r)
            assert torch.equal(y, y_ref) and torch.equal(c, r), k


def test_a_restore_that_raises_half_way_leaves_the_session(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    s = prog.session("s")
    state = list(_call(s, 2, 0, list(model.initial_state()))[1:])
    snap = s.snapshot()
    state = list(_call(s, 2, 1, state)[1:])
    probe = FaultAt(0)
    with probe:
        s.restore(snap)
    state = list(_call(s, 2, 1, list(s.restore(snap).values())))[1:]  # back where the snapshot was, then on
    kept = [t.clone() for t in state]
    for at in range(1, probe.n + 1):
        with pytest.raises(Fault), FaultAt(at):
            s.restore(snap)
        assert all(torch.equal(a, b) for a, b in zip(state, kept)), at
    ref = cf.reference(eps)
    r = list(_call(ref, 2, 0, list(model.initial_state()))[1:])
    r = list(_call(ref, 2, 1, r)[1:])
    assert _same(_call(ref, 2, 2, r), _call(s, 2, 2, state))  # the views survived every failed restore


def test_a_snapshot_of_another_model_or_dtype_is_refused_whole(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    s = prog.session("s")
    state = list(_call(s, 3, 0, list(model.initial_state()))[1:])
    snap = s.snapshot()
    kept = [t.clone() for t in state]
    names = list(snap.state)
    other = cf.Snapshot({**snap.state, "not_a_region": torch.zeros(3)}, snap.rng)
    with pytest.raises(cf.StateMismatch, match=r"region\(s\) \['not_a_region'\].*another model"):
        s.restore(other)
    wide = cf.Snapshot({names[0]: snap.state[names[0]], names[1]: snap.state[names[1]].double()}, snap.rng)
    with pytest.raises(cf.StateMismatch, match=rf"region '{names[1]}': a state of dtype torch.float64"):
        s.restore(wide)  # the first region is fine: nothing is written unless every one is
    assert all(torch.equal(a, b) for a, b in zip(state, kept))
    ref = cf.reference(eps)
    r = list(_call(ref, 3, 0, list(model.initial_state()))[1:])
    assert _same(_call(ref, 3, 1, r), _call(s, 3, 1, state))


def test_a_float64_state_is_refused_not_rounded(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    state = [t.double() for t in model.initial_state()]
    for fn in (prog, prog.session()):
        with pytest.raises((cf.StateMismatch, cf.CatalogMiss)):
            _call(fn, 1, 0, state)


def test_a_closed_sessions_view_keeps_its_bytes(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    s = prog.session("s")
    out = _call(s, 4, 0, list(model.initial_state()))
    want = [t.clone() for t in out]
    s.close()
    gc.collect()
    assert all(torch.equal(t.clone(), w) for t, w in zip(out, want))  # read and cloned: the bytes, no crash
    assert all(torch.equal(t, w) for t, w in zip(out, want))
    # fed to another session, the closed session's last state is a plain tensor: copied in, exact
    t = prog.session("t")
    ref = cf.reference(eps)
    r = list(_call(ref, 4, 0, list(model.initial_state()))[1:])
    assert _same(_call(ref, 4, 1, r), _call(t, 4, 1, list(out[1:])))


def test_a_session_dropped_without_close_is_reclaimed(setup):
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay="off")
    s = prog.session("dropped")
    _call(s, 5, 0, list(model.initial_state()))
    gone = weakref.ref(s)
    del s
    gc.collect()
    assert gone() is None and prog.sessions() == [] and prog.memory_census()["sessions"] == 0


def test_an_older_state_of_another_program_is_stale_there(setup):
    model, contract, eps = setup
    a, b = cf.optimize(eps, contract, replay="off"), cf.optimize(eps, contract, replay="off")
    ref = cf.reference(eps)
    old = list(_call(a, 6, 0, list(model.initial_state()))[1:])
    now = list(_call(a, 6, 1, old)[1:])
    for fn in (b, b.session()):
        with pytest.raises(cf.StaleState):
            _call(fn, 6, 2, old)  # a's bytes there were overwritten by a's second call
    r = list(_call(ref, 6, 0, list(model.initial_state()))[1:])
    r = list(_call(ref, 6, 1, r)[1:])
    assert _same(_call(ref, 6, 2, r), _call(b, 6, 2, now))  # a's current state: copied in, exact


def test_the_default_program_and_sessions_on_threads_keep_their_own_views(setup):
    """lanes=2: sessions run on lane 1 only while the default state stays in lane 0, so the views the
    default program returned keep their bytes while sessions run beside it."""
    model, contract, eps = setup
    prog = cf.optimize(eps, contract, replay=FakeBackend(), lanes=2)
    calls, errors = 12, []
    got: dict[str, list] = {"default": [], "s1": [], "s2": []}

    def run(name, fn, seed):
        try:
            state = [t + seed * 0.01 for t in model.initial_state()]
            for k in range(calls):
                out = _call(fn, seed, k, state)
                first = [t.clone() for t in out]
                for _ in range(3):  # read the returned views a while, as a consumer does
                    if not all(torch.equal(t, f) for t, f in zip(out, first)):
                        errors.append(f"{name}: call {k}'s returned view changed under another caller")
                got[name].append(first)
                state = list(out[1:])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=("default", prog, 1)),
               threading.Thread(target=run, args=("s1", prog.session("s1"), 2)),
               threading.Thread(target=run, args=("s2", prog.session("s2"), 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ref = cf.reference(eps)
    for name, seed in (("default", 1), ("s1", 2), ("s2", 3)):
        state = [t + seed * 0.01 for t in model.initial_state()]
        for k in range(calls):
            r = _call(ref, seed, k, state)
            assert _same(r, got[name][k]), (name, k)
            state = [t.clone() for t in r[1:]]
