"""A history the step keeps in a workspace of its own (a solver loop writing each step's ``history + new``
into a module buffer, then a trim) becomes the region buffer (``passes.envelope_state``): one copy of
the history instead of two, bit-exact with ``ep.module()`` on every call, the region at one address.
Patterns the pass cannot prove (the workspace read before this call wrote it, the input read after a
write overwrote it) keep the workspace, are reported, and stay exact; an input read by an op whose
result may depend on strides reads a contiguous copy.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.annotations import CONTIGUOUS_INPUT_COPY, HISTORY_WORKSPACE_KEPT
from cadence_fx.plan import state_traffic

VARIANTS = ("ok", "stride_reader", "read_before_write", "late_input_read")


class WorkspaceStep(torch.nn.Module):
    """``steps`` solver steps over a ``(steps, *dims)`` history with the clock at ``axis`` (never 0).

    Step ``s`` concatenates its history ``cache[s]`` with ``n`` new frames (in ``order``), writes the
    result into its slice of the workspace ``ws`` (which has ``dead`` unused steps and room for
    ``t_max`` frames, like the stock Token2Wav solver), and feeds a sum of it forward; the step
    returns the workspace's filled front, trimmed by ``keep`` (a callable on the extent).
    """

    def __init__(self, steps: int, dead: int, dims: tuple[int, ...], axis: int, n: int, order: str,
                 t_max: int, keep, variant: str = "ok"):
        super().__init__()
        self.steps, self.axis, self.n, self.order, self.keep, self.variant = steps, axis, n, order, keep, variant
        self.dims = dims
        shape = [steps + dead, *dims]
        shape.insert(axis, t_max)
        self.register_buffer("ws", torch.zeros(shape), persistent=False)
        self.proj = torch.nn.Linear(3, n * math.prod(dims))
        self.mix = torch.nn.Linear(3, 3)

    def forward(self, x, cache):
        ax = self.axis - 1  # the clock axis of one step's history
        t = cache.shape[self.axis]
        m = t + self.n
        y = torch.zeros(())
        h = x
        for s in range(self.steps):
            new = self.proj(h).reshape(self.n, *self.dims).movedim(0, ax)
            hist = cache[s]
            if self.variant == "read_before_write":  # last call's bytes of the workspace reach the output
                y = y + self.ws[s].narrow(ax, 0, m).sum()
            if self.variant == "stride_reader":  # a reduction over the input itself (strides may matter)
                y = y + cache[s].sum(ax).sum()
            kv = torch.cat([hist, new] if self.order == "old_new" else [new, hist], ax)
            self.ws[s].narrow(ax, 0, m).copy_(kv)
            if self.variant == "late_input_read":  # the input, after the write that overwrites it
                y = y + cache[s].sum()
            y = y + kv.sum()
            h = self.mix(h) + kv.mean()
        out = self.ws.narrow(self.axis, 0, m)
        return y + h.sum(), self.keep(out, self.axis, m)


def _head_tail(head: int, tail: int):
    def keep(out, axis, m):
        if m <= head + tail:
            return out
        return torch.cat([out.narrow(axis, 0, head), out.narrow(axis, m - tail, tail)], axis)
    return keep


def _window(size: int):
    def keep(out, axis, m):
        return out if m <= size else out.narrow(axis, m - size, size)
    return keep


def _case(steps, dead, dims, axis, n, order, policy, variant):
    if policy[0] == "head_tail":
        _, head, tail = policy
        retention, keep, initial, bound = cf.HeadTail(head, tail), _head_tail(head, tail), head, head + tail
    else:
        _, size = policy
        retention, keep, initial, bound = cf.SlidingWindow(size), _window(size), 0, size
    step = WorkspaceStep(steps, dead, dims, axis, n, order, bound + n + 2, keep, variant).eval()
    live = {0: steps} if dead else {}
    contract = cf.Contract(clocks=(cf.Clock("frame", n),), regions=(
        cf.Region("hist", input="cache", output=1, clock="frame", axis=axis, order=order, retention=retention,
                  initial=initial, live=live),))
    shape = [steps + dead, *dims]
    shape.insert(axis, initial)
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(1, 3), "cache": torch.zeros(shape)})
    return step, contract, eps, shape


def _stream(contract, eps, shape, live_steps: int, calls: int, seed: int = 0):
    """The stock stream (``ep.module()`` through cf.reference), then the optimized program's from the same
    start; every output of every call compared. The workspace is put back between the two runs: a
    program that keeps it at its stock size runs on the module's own buffer (a step that reads it
    before writing it carries state there the contract does not declare)."""
    prog = cf.optimize(eps, contract, replay="off")
    stock = cf.reference(eps)
    buffers = {id(t): t for ep in eps for t in ep.constants.values() if isinstance(t, torch.Tensor)}
    saved = {k: t.clone() for k, t in buffers.items()}
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(shape, generator=g)
    xs = [torch.randn(1, 3, generator=g) for _ in range(calls)]
    refs, cache = [], first
    with torch.no_grad():
        for x in xs:
            ref = stock(x, cache)
            refs.append([t.clone() for t in ref])
            cache = refs[-1][1]
    for k, t in buffers.items():
        t.copy_(saved[k])
    cache = first.narrow(0, 0, live_steps).clone()  # the live steps are the state
    for k, (x, ref) in enumerate(zip(xs, refs)):
        out = prog(x, cache)
        assert torch.equal(ref[0], out[0]), f"call {k}: output 0 differs from ep.module()"
        assert torch.equal(ref[1].narrow(0, 0, live_steps), out[1]), f"call {k}: the state differs"
        cache = out[1]
        assert cache.data_ptr() == prog.region_pointer("hist"), "the region moved"
    return prog


@st.composite
def cases(draw):
    rank = draw(st.integers(3, 4))
    axis = draw(st.integers(1, rank - 1))
    dims = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(rank - 2))
    n = draw(st.integers(1, 3))
    order = draw(st.sampled_from(["old_new", "new_old"]))
    policy = draw(st.one_of(st.tuples(st.just("head_tail"), st.integers(0, 3), st.integers(1, 4)),
                            st.tuples(st.just("window"), st.integers(1, 5))))
    return draw(st.integers(1, 3)), draw(st.integers(0, 2)), dims, axis, n, order, policy, \
        draw(st.sampled_from(VARIANTS))


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_history_workspace_becomes_the_region_buffer(case):
    steps, dead, dims, axis, n, order, policy, variant = case
    note(f"steps={steps} dead={dead} dims={dims} axis={axis} n={n} order={order} policy={policy} variant={variant}")
    _step, contract, eps, shape = _case(steps, dead, dims, axis, n, order, policy, variant)
    prog = _stream(contract, eps, shape, steps, calls=len(eps) + 3)
    (rp,) = prog.plan.regions
    merged = prog.stats["passes"].get("envelope_state", 0)
    notes = [f for e in state_traffic(prog) for f in e["left_stock"] if f.region is not None]
    if all(s == 1 for s in shape[:axis]):  # an outermost clock axis: appended in place, no envelope
        assert rp.layout == "prefix" and merged == 0
        return
    assert rp.layout == "envelope"
    if variant in ("ok", "stride_reader"):
        assert merged == len(eps), notes
        assert prog.workspaces() == [], "the history workspace is still a copy of its own"
    else:  # refused wherever the history is not empty (with none, nothing can be read too late)
        assert merged < len(eps) and any(f.pattern == HISTORY_WORKSPACE_KEPT and f.region == "hist"
                                         for f in notes), notes
    # a reduction over the input itself (before or after the writes) reads a contiguous copy
    assert any(f.pattern == CONTIGUOUS_INPUT_COPY and f.region == "hist"
               for f in notes) == (variant in ("stride_reader", "late_input_read")), notes


def test_merged_history_costs_what_the_stock_writes():
    """Token2Wav's shape of the pattern (new-then-old, head + tail): the state bytes one call writes
    never exceed the stock program's, and the region buffer is the envelope (no second history)."""
    _step, contract, eps, shape = _case(2, 1, (2, 3), 2, 2, "new_old", ("head_tail", 2, 3), "ok")
    prog = _stream(contract, eps, shape, 2, calls=len(eps) + 3)
    (rp,) = prog.plan.regions
    assert rp.stored_shape == (2, 2, 2 + 3 + 2, 3)  # live steps, clock axis at head + tail + n
    assert prog.region_buffers["hist"].numel() == math.prod(rp.stored_shape)
    for e in state_traffic(prog):
        b = e["regions"]["hist"]
        assert b["optimized"] <= b["stock"], e


def test_sessions_store_the_compact_state():
    """A session stores its state contiguous (attended extent), not the lanes' envelope; its stream
    equals a solo run through the program."""
    _step, contract, eps, shape = _case(2, 0, (2,), 1, 1, "old_new", ("window", 3), "ok")
    prog = cf.optimize(eps, contract, replay="off")
    (rp,) = prog.plan.regions
    s = prog.session("a")
    assert s.nbytes() == math.prod(rp.session_shape) * 4 < prog.region_buffers["hist"].numel() * 4
    g = torch.Generator().manual_seed(3)
    solo_cache = s_cache = torch.zeros(shape)
    solo = cf.optimize(eps, contract, replay="off")
    for k in range(5):
        x = torch.randn(1, 3, generator=g)
        a, b = solo(x, solo_cache), s(x, s_cache)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"call {k}"
        solo_cache, s_cache = a[1], b[1]
        assert s_cache.is_contiguous() and not a[1].is_contiguous() or a[1].shape[1] == 0
        host = cf.state_to(a[1], "cpu")  # a strided state out to the host: a contiguous copy
        assert host.is_contiguous() and torch.equal(host, a[1])


@pytest.mark.parametrize("bad", ["wider", "longer"])
def test_a_state_that_does_not_fit_the_envelope_is_refused(bad):
    """The one place a state becomes a view of an envelope buffer checks the fit (the catalog already
    refuses shapes no class has; this guards copies made by sessions and restores)."""
    _step, contract, eps, shape = _case(2, 0, (2,), 1, 1, "old_new", ("window", 3), "ok")
    prog = cf.optimize(eps, contract, replay="off")
    site = prog.region_sites()["hist"]
    shape = list(site.envelope)
    if bad == "wider":
        shape[2] += 1
    else:
        shape[1] += 1
    with pytest.raises(ValueError, match="envelope"):
        site.state_view(prog.region_buffers["hist"], shape)


def test_box_cover_is_exact_and_bounded():
    """The coverage check behind "every read sees only this call's writes": tiles cover, a gap does not,
    and a cover too fragmented to check answers False (the workspace is then kept)."""
    from cadence_fx.analysis.boxes import box_covered

    box = [(0, 10), (0, 4)]
    rows = [[(i, i + 1), (0, 4)] for i in range(10)]
    assert box_covered(box, rows)
    assert not box_covered(box, rows[:4] + rows[5:])                  # row 4 never written
    assert box_covered(box, [[(0, 10), (0, 2)], [(0, 5), (2, 4)], [(5, 10), (1, 4)]])
    assert not box_covered(box, [[(0, 10), (0, 2)], [(0, 5), (2, 4)], [(5, 10), (3, 4)]])
    assert box_covered([(3, 3), (0, 4)], [])                          # an empty read needs nothing
    cells = [[(i, i + 1), (j, j + 1), (k, k + 1)] for i in range(12) for j in range(12) for k in range(12)]
    assert not box_covered([(0, 12), (0, 12), (0, 12)], list(reversed(cells)))  # past the budget: refused


def test_copy_states_copies_every_pair_bitwise_into_strided_views():
    """A session call's copy-in: every region as one operator, strided (envelope) targets included."""
    from cadence_fx.runtime.state import copy_states
    g = torch.Generator().manual_seed(0)
    bufs = [torch.zeros(4, 6, dtype=torch.float32), torch.zeros(3, 5, dtype=torch.bfloat16),
            torch.zeros((), dtype=torch.int64)]
    dsts = [bufs[0][:, 1:4], bufs[1].t()[:, :2], bufs[2]]
    srcs = [torch.randn(4, 3, generator=g), torch.randn(5, 2, generator=g).to(torch.bfloat16), torch.tensor(7)]
    before = bufs[0].clone()
    copy_states(dsts, srcs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    assert torch.equal(bufs[0][:, [0, 4, 5]], before[:, [0, 4, 5]])  # nothing outside the views written
