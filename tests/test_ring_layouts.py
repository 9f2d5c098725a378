"""The state rule for every cache layout: rings written any way export keeps them, caches concatenated
along any axis. Every output of every call is bit-exact with ``ep.module()``; the region stays at one
address; the state bytes one call writes (counted from the graphs, ``cadence_fx.plan.state_traffic``)
never exceed the unmodified program's where the rule rewrites, and the known cost where it cannot.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.annotations import RING_UPDATE_KEPT, TRAFFIC_ABOVE_STOCK, Finding
from cadence_fx.plan import state_traffic

FORMS = ("index_copy", "index_copy_", "scatter", "scatter_", "index_put", "clone_index_put_", "slice_")
F32 = 4


def _cache_shape(dims: tuple[int, ...], axis: int, extent: int) -> tuple[int, ...]:
    shape = list(dims)
    shape.insert(axis, extent)
    return tuple(shape)


class RingStep(torch.nn.Module):
    """Writes ``n`` new positions of a ``capacity``-position ring at ``pos`` (wrapping), reads it whole."""

    def __init__(self, dims: tuple[int, ...], axis: int, form: str, n: int, offset: int = 0):
        super().__init__()
        self.dims, self.axis, self.form, self.n, self.offset = dims, axis, form, n, offset
        feat = math.prod(dims)
        self.proj = torch.nn.Linear(3, feat)
        self.q = torch.nn.Linear(3, feat)

    def forward(self, x, cache, pos):
        ax = self.axis
        new = self.proj(x).reshape(self.n, *self.dims).movedim(0, ax)
        shape = [1] * cache.dim()
        shape[ax] = self.n
        index = pos.view(shape).expand_as(new)
        where = (slice(None),) * ax + (pos,)
        if self.form == "index_copy":
            ring = cache.index_copy(ax, pos, new)
        elif self.form == "index_copy_":
            ring = cache.index_copy_(ax, pos, new)
        elif self.form == "scatter":
            ring = cache.scatter(ax, index, new)
        elif self.form == "scatter_":
            ring = cache.scatter_(ax, index, new)
        elif self.form == "index_put":
            # every dim up to the clock axis indexed: the index broadcasts to (dims before the axis..., n)
            lead = tuple(torch.arange(s).view([-1] + [1] * (ax - d)) for d, s in enumerate(cache.shape[:ax]))
            ring = torch.index_put(cache, lead + (pos,), new)
        elif self.form == "clone_index_put_":
            ring = cache.clone()
            ring[where] = new
        else:  # a slice assignment at a static offset (export bakes it)
            cache.narrow(ax, self.offset, self.n).copy_(new)
            ring = cache
        flat = ring.movedim(ax, 0).reshape(ring.shape[ax], -1)
        att = torch.softmax(self.q(x) @ flat.T, -1) @ flat
        return att, ring


def _ring_contract(axis: int, n: int, capacity: int) -> cf.Contract:
    return cf.Contract(clocks=(cf.Clock("frame", n),), regions=(
        cf.Region("ring", input="cache", output=1, clock="frame", axis=axis, order=None,
                  retention=cf.Ring(capacity), initial=capacity),))


def _export_ring(step: RingStep, capacity: int, decompose: bool):
    args = (torch.zeros(step.n, 3), torch.zeros(_cache_shape(step.dims, step.axis, capacity)), torch.arange(step.n))
    ep = torch.export.export(step, args)
    return ep.run_decompositions({}) if decompose else ep


def _stream_ring(step: RingStep, ep, capacity: int, start: int, calls: int, *, verify: bool = False):
    """Run ``ep.module()`` and the optimized program side by side; returns the program."""
    prog = cf.optimize([ep], _ring_contract(step.axis, step.n, capacity), replay="off", verify=verify)
    stock = ep.module()
    g = torch.Generator().manual_seed(capacity * 31 + start)
    cache0 = torch.randn(_cache_shape(step.dims, step.axis, capacity), generator=g)
    ref_cache, cache = cache0.clone(), cache0.clone()
    for k in range(calls):
        x = torch.randn(step.n, 3, generator=g)
        pos = (torch.arange(step.n) + start + k * step.n) % capacity  # wraps around the ring
        with torch.no_grad():
            ref = stock(x, ref_cache, pos.clone())
        out = prog(x, cache, pos.clone())
        for j, (a, b) in enumerate(zip(ref, out)):
            assert torch.equal(a, b), f"call {k}, output {j} differs from ep.module()"
        ref_cache, cache = ref[1].clone(), out[1]
        assert cache.data_ptr() == prog.region_pointer("ring"), "the region moved"
    return prog


def _bytes(prog) -> dict[str, int]:
    (entry,) = state_traffic(prog)
    return entry["regions"]["ring"]


@st.composite
def ring_cases(draw):
    capacity = draw(st.integers(2, 8))
    n = draw(st.integers(1, capacity))
    axis = draw(st.integers(0, 3))
    dims = tuple(draw(st.sampled_from([1, 2])) for _ in range(3))
    form = draw(st.sampled_from(FORMS))
    offset = draw(st.integers(0, capacity - n))
    start = draw(st.integers(0, capacity - 1))
    decompose = draw(st.booleans())
    return capacity, n, axis, dims, form, offset, start, decompose


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ring_cases())
def test_ring_updates_are_exact_stable_and_write_only_the_new_positions(case):
    capacity, n, axis, dims, form, offset, start, decompose = case
    note(f"capacity={capacity} n={n} axis={axis} dims={dims} form={form} offset={offset} start={start} "
         f"decompose={decompose}")
    step = RingStep(dims, axis, form, n, offset).eval()
    ep = _export_ring(step, capacity, decompose)
    prog = _stream_ring(step, ep, capacity, start, calls=capacity // n + 3)
    b = _bytes(prog)
    new_bytes = n * math.prod(dims) * F32
    assert prog.stats["passes"].get("retention_in_place", 0) == 0, "the ring was copied into its buffer"
    assert b["optimized"] == new_bytes, (b, new_bytes)  # the new positions, once: no whole-ring traffic
    assert b["optimized"] <= b["stock"]
    assert not state_traffic(prog)[0]["left_stock"]


# ------------------------------------------------------------------------------ concatenated caches

class CatStep(torch.nn.Module):
    """``cat([cache, new])`` along ``axis`` of a ``dims`` layout, read whole, then a sliding window."""

    def __init__(self, dims: tuple[int, ...], axis: int, n: int, window: int):
        super().__init__()
        self.dims, self.axis, self.n, self.window = dims, axis, n, window
        self.proj = torch.nn.Linear(3, math.prod(dims))

    def forward(self, x, cache):
        new = self.proj(x).reshape(self.n, *self.dims).movedim(0, self.axis)
        kv = torch.cat([cache, new], self.axis)
        m = kv.shape[self.axis]
        return kv.movedim(self.axis, 0).reshape(m, -1).sum(0), kv.narrow(self.axis, max(m - self.window, 0),
                                                                         min(m, self.window))


@st.composite
def cat_cases(draw):
    rank = draw(st.integers(2, 4))
    axis = draw(st.integers(0, rank - 1))
    dims = tuple(draw(st.sampled_from([1, 1, 2])) for _ in range(rank - 1))
    n = draw(st.integers(1, 3))
    window = draw(st.integers(1, 6))
    return dims, axis, n, window


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cat_cases())
def test_concatenated_caches_on_every_axis_are_exact_and_cost_what_is_measured(case):
    dims, axis, n, window = case
    note(f"dims={dims} axis={axis} n={n} window={window}")
    step = CatStep(dims, axis, n, window).eval()
    contract = cf.Contract(clocks=(cf.Clock("frame", n),), regions=(
        cf.Region("kv", input="cache", output=1, clock="frame", axis=axis, order="old_new",
                  retention=cf.SlidingWindow(window), initial=0),))
    eps = cf.export_catalog(step, contract, {"x": torch.zeros(n, 3), "cache": torch.zeros(_cache_shape(dims, axis, 0))})
    prog = cf.optimize(eps, contract, replay="off")
    stock = cf.reference(eps)
    g = torch.Generator().manual_seed(window)
    cache = torch.zeros(_cache_shape(dims, axis, 0))
    ref_cache = cache.clone()
    for k in range(len(eps) + 3):
        x = torch.randn(n, 3, generator=g)
        ref = stock(x, ref_cache)
        out = prog(x, cache)
        for j, (a, b) in enumerate(zip(ref, out)):
            assert torch.equal(a, b), f"call {k}, output {j} differs from ep.module()"
        ref_cache, cache = ref[1].clone(), out[1]
        assert cache.data_ptr() == prog.region_pointer("kv")
    rest = math.prod(dims) * F32
    leading = all(s == 1 for s in dims[:axis])
    for entry in state_traffic(prog):
        t, b = entry["class"]["kv"], entry["regions"]["kv"]
        assert b["stock"] == (t + n) * rest  # the stock cat, nothing else
        if leading:  # new frames written in place; a trim moves the kept frames once (chunked, no staging)
            moved = min(window, t + n) if t + n > window else 0
            assert b["optimized"] == n * rest + moved * rest, (entry, dims, axis)
            # never more than the stock cat, except on a call whose history is still shorter than the
            # window it trims to (t < window < t + n): there the kept frames move by more than were kept
            assert b["optimized"] <= b["stock"] + max(0, window - t) * rest * (t + n > window)
            if t >= window or t + n <= window:
                assert b["optimized"] <= b["stock"]
        elif prog.plan.region("kv").layout == "envelope" and t + n == prog.plan.region("kv").envelope:
            # the cat fills the envelope: the new frames appended behind the state in place, the kept
            # tail shifted to the front: what the stock cat moves, no more
            assert b["optimized"] == b["stock"], (entry, dims, axis)
        else:  # a class whose cat is shorter than the envelope: the stock cat, then the kept extent copied
            assert b["optimized"] == b["stock"] + min(window, t + n) * rest, (entry, dims, axis)


# ------------------------------------------------------------------------------------ unit tests

@pytest.mark.parametrize("form", ["index_copy", "scatter", "index_put", "clone_index_put_"])
def test_functional_ring_update_becomes_an_in_place_write(form):
    step = RingStep((2, 1, 3), 2, form, 2).eval()
    ep = _export_ring(step, 8, decompose=False)
    prog = _stream_ring(step, ep, 8, start=5, calls=6)
    assert prog.stats["passes"]["ring_in_place"] >= 1
    assert prog.stats["passes"].get("retention_in_place", 0) == 0
    (gm,) = prog.graph_modules()
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not {"aten.index_copy.default", "aten.scatter.src", "aten.index_put.default", "aten.clone.default"} & targets
    b = _bytes(prog)
    assert b["stock"] >= 8 * 6 * F32 and b["optimized"] == 2 * 6 * F32


def test_decomposed_in_place_ring_loses_the_copy_back():
    """run_decompositions turns ``index_copy_`` into ``index_copy`` + a whole ``copy_`` back into the input."""
    step = RingStep((1, 2, 2), 1, "index_copy_", 3).eval()
    ep = _export_ring(step, 7, decompose=True)
    assert any(n.target is torch.ops.aten.index_copy.default for n in ep.graph.nodes)
    prog = _stream_ring(step, ep, 7, start=6, calls=5)
    b = _bytes(prog)
    assert b == {"stock": 2 * 7 * 4 * F32, "optimized": 3 * 4 * F32}


def test_functional_ring_update_under_verify_is_audited():
    step = RingStep((2, 2, 1), 0, "scatter", 2).eval()
    prog = _stream_ring(step, _export_ring(step, 4, decompose=False), 4, start=3, calls=4, verify=True)
    (gm,) = prog.graph_modules()
    audits = [n.args[2] for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "audit"]
    assert sorted(audits) == ["retention", "ring write"]  # the in-place write against the stock scatter
    assert prog.auditor.checks == 2 * 4


class ReadsOldRing(torch.nn.Module):
    """Reads the old ring after the functional update: writing in place would change that read."""

    def __init__(self, alias_src: bool = False):
        super().__init__()
        self.alias_src = alias_src
        self.proj = torch.nn.Linear(3, 4)

    def forward(self, x, cache, pos):
        src = cache.narrow(1, 0, 2).flip(1) if self.alias_src else self.proj(x).view(1, 2, 4)
        ring = cache.index_copy(1, pos, src)
        return ring.sum(1) * cache.sum(1) if not self.alias_src else ring.sum(1), ring


@pytest.mark.parametrize("alias_src", [False, True])
def test_unprovable_ring_update_is_left_stock_and_reported(alias_src):
    step = ReadsOldRing(alias_src).eval()
    ep = torch.export.export(step, (torch.zeros(2, 3), torch.zeros(1, 6, 4), torch.arange(2)))
    prog = cf.optimize([ep], _ring_contract(1, 2, 6), replay="off")
    stock = ep.module()
    cache = torch.randn(1, 6, 4)
    ref_cache = cache.clone()
    for k in range(5):
        x, pos = torch.randn(2, 3), (torch.arange(2) + 2 * k) % 6
        with torch.no_grad():
            ref = stock(x, ref_cache, pos)
        out = prog(x, cache, pos)
        assert all(torch.equal(a, b) for a, b in zip(ref, out))
        ref_cache, cache = ref[1].clone(), out[1]
    (entry,) = state_traffic(prog)
    if alias_src:
        assert not entry["left_stock"]  # flip() copies: its result does not view the ring, the write is exact
    else:
        found, above = entry["left_stock"]  # the ring kept stock, then the cost of that, said
        assert (above.pattern, above.region) == (TRAFFIC_ABOVE_STOCK, "ring") and found.reason in above.reason
        assert (found.pattern, found.region) == (RING_UPDATE_KEPT, "ring"), found
        assert "reads the old region after" in found.reason, found
        assert found.cls == tuple(entry["class"].items())
        assert str(found) == f"region 'ring': {found.reason}; the functional update is left stock (whole region " \
                             "rebuilt and copied)"  # the sentence the plan and the logs print
        assert Finding.from_dict(found.to_dict()) == found
        assert prog.stats["passes"].get("ring_in_place", 0) == 0
        # left stock: the whole functional result, then its copy into the region buffer
        assert entry["regions"]["ring"] == {"stock": 6 * 4 * F32, "optimized": 2 * 6 * 4 * F32}


def test_a_saved_program_keeps_its_findings(tmp_path):
    """``left_stock`` records survive ``cf.save`` / ``cf.load`` field by field; a stored finding of
    an unknown kind is an ArtifactError, not a raw exception."""
    import hashlib
    import json

    step = ReadsOldRing(False).eval()
    ep = torch.export.export(step, (torch.zeros(2, 3), torch.zeros(1, 6, 4), torch.arange(2)))
    contract = cf.Contract(clocks=(cf.Clock("frame", 2),), wrap=(cf.WHOLE_STEP,), regions=(
        cf.Region("ring", input="cache", output=1, clock="frame", axis=1, order=None,
                  retention=cf.Ring(6), initial=6),))
    prog = cf.optimize([ep], contract, replay="off")
    path = tmp_path / "ring.cfx"
    cf.save(prog, path)
    (want, want_above), (got, got_above) = (state_traffic(p)[0]["left_stock"] for p in (prog, cf.load(path)))
    assert isinstance(got, Finding) and got == want and got.pattern == RING_UPDATE_KEPT
    assert got_above == want_above and got_above.pattern == TRAFFIC_ABOVE_STOCK
    payload = torch.load(path, weights_only=True)
    text = payload["manifest"].replace(json.dumps(RING_UPDATE_KEPT), '"no_such_kind"')
    assert text != payload["manifest"]

    payload.update(manifest=text, manifest_sha256=hashlib.sha256(text.encode()).hexdigest())
    torch.save(payload, path)
    with pytest.raises(cf.ArtifactError, match="left_stock holds a finding that is not one"):
        cf.load(path)


def test_ring_update_from_a_view_of_itself_is_refused():
    class SelfView(torch.nn.Module):
        def forward(self, x, cache, pos):
            ring = cache.index_copy(1, pos, cache.narrow(1, 0, 2) + 0 * x.sum())
            return ring.sum(), ring

    class SelfAlias(torch.nn.Module):
        def forward(self, x, cache, pos):
            return x.sum(), cache.index_copy(1, pos, cache.narrow(1, 0, 2))

    for model, refused in ((SelfView(), False), (SelfAlias(), True)):
        ep = torch.export.export(model, (torch.zeros(2), torch.zeros(1, 6, 4), torch.arange(2)))
        prog = cf.optimize([ep], _ring_contract(1, 2, 6), replay="off")
        (entry,) = state_traffic(prog)
        assert bool(entry["left_stock"]) == refused, entry
        if refused:
            found, _above = entry["left_stock"]
            assert (found.pattern, found.region) == (RING_UPDATE_KEPT, "ring"), found
            assert "reads the region's own storage" in found.reason, found
        stock = ep.module()
        cache = torch.randn(1, 6, 4)
        ref_cache = cache.clone()
        for k in range(4):
            pos = torch.tensor([4, 5]) if k % 2 else torch.tensor([0, 3])
            with torch.no_grad():
                ref = stock(torch.ones(2), ref_cache, pos)
            out = prog(torch.ones(2), cache, pos)
            assert all(torch.equal(a, b) for a, b in zip(ref, out))
            ref_cache, cache = ref[1].clone(), out[1]


def test_rewritten_ring_in_sessions_matches_solo_runs():
    step = RingStep((2, 1, 2), 3, "index_copy", 2).eval()
    ep = _export_ring(step, 6, decompose=False)
    prog = cf.optimize([ep], _ring_contract(3, 2, 6), replay="off", lanes=2)
    stock = ep.module()
    sessions = [prog.session(f"s{i}") for i in range(3)]
    caches = [torch.randn(_cache_shape((2, 1, 2), 3, 6)) for _ in sessions]
    refs = [c.clone() for c in caches]
    for k in range(5):
        for i, s in enumerate(sessions):  # interleaved: each session's state is its own
            x, pos = torch.randn(2, 3), (torch.arange(2) + 2 * k + i) % 6
            with torch.no_grad():
                ref = stock(x, refs[i], pos)
            out = s(x, caches[i], pos)
            assert all(torch.equal(a, b) for a, b in zip(ref, out)), (k, i)
            refs[i], caches[i] = ref[1].clone(), out[1]
