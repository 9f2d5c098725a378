"""``cat_into_place``: ``dst.copy_(cat(pieces))`` -> ``cat(pieces, out=dst)`` only where provably the same bytes.

Each case traces a small function to ATen (``make_fx``), runs the pass, and compares every output and
every written input of the rewritten graph with the traced one on the same inputs, bit for bit. The
cases the pass must refuse are the ones where fusing would read a piece after it changed, or write
over a piece before reading it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from cadence_fx.contract import Contract
from cadence_fx.passes import PassConfig, PassContext, ProgramFacts
from cadence_fx.runtime.workspaces import CatalogTables
from cadence_fx.passes.cat_into_place import cat_into_place


def _run_pass(fn, *inputs, pre_dispatch=False):
    # pre_dispatch keeps composite ops (dropout, linear) as nodes, as torch.export's graphs have them
    gm = make_fx(fn, tracing_mode="fake", pre_dispatch=pre_dispatch)(*inputs)
    stock = copy.deepcopy(gm)
    ctx = PassContext(PassConfig(Contract(clocks=(), regions=(), wrap=())), CatalogTables(), ProgramFacts({}, {}))
    out = cat_into_place(gm, ctx)
    out.recompile()
    return stock, out, ctx.program.changed.get("cat_into_place", 0)


def _same(stock, fused, *inputs):
    a = [t.clone() for t in inputs]
    b = [t.clone() for t in inputs]
    ra, rb = stock(*a), fused(*b)
    ra, rb = (ra if isinstance(ra, (tuple, list)) else (ra,)), (rb if isinstance(rb, (tuple, list)) else (rb,))
    for x, y in zip(ra, rb):
        assert torch.equal(x, y)
    for x, y in zip(a, b):  # what each wrote into its inputs
        assert torch.equal(x, y)


def _cases():
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(2, 6, 5, generator=g)
    a = torch.randn(2, 4, 5, generator=g)
    b = torch.randn(2, 2, 5, generator=g)

    def fresh(d, x, y):  # the estimator's pattern: new pieces computed, concatenated, stored
        d.copy_(torch.cat([x * 2, y + 1], 1))
        return d * 1

    def slices_of_fresh(d, x, y):  # pieces are slices of fresh tensors (the convolution cache's tail)
        t, u = torch.cat([x, x], 1) * 3, y - 1
        d[:, :4].copy_(torch.cat([t[:, -2:], u], 1))
        return t

    def two_stores(d, x, y):  # another store into the same buffer sits between the cat and its copy
        c = torch.cat([x * 2, y * 2], 1)
        d[0].copy_(torch.zeros_like(d[0]))
        d.copy_(c)
        return y + 1

    def piece_is_input(d, x, y):  # a piece the caller owns may alias d: not provable
        d.copy_(torch.cat([x, y * 2], 1))
        return d

    def piece_views_dst_root(d, x, y):  # pieces and destination in one fresh tensor
        t = torch.cat([x, y, x], 1) * 2
        t[:, :4].copy_(torch.cat([t[:, 4:6], t[:, 6:8]], 1))
        return t

    def piece_written_between(d, x, y):  # fusing would read the piece after the add_
        p = x * 2
        c = torch.cat([p, y * 2], 1)
        p.add_(1)
        d.copy_(c)
        return p

    def broadcast_copy(d, x, y):  # the copy broadcasts the cat over d's leading dim
        d.copy_(torch.cat([x[:1] * 2, y[:1] * 2], 1))
        return d

    def converting_copy(d, x, y):  # the copy converts the dtype
        d.copy_(torch.cat([x * 2, y * 2], 1).double())
        return d

    def cat_used_twice(d, x, y):
        c = torch.cat([x * 2, y * 2], 1)
        d.copy_(c)
        return c + 1

    return [(fresh, 1), (slices_of_fresh, 1), (two_stores, 1), (piece_is_input, 0), (piece_views_dst_root, 0),
            (piece_written_between, 0), (broadcast_copy, 0), (converting_copy, 0), (cat_used_twice, 0)], (dst, a, b)


CASES, INPUTS = _cases()


@pytest.mark.parametrize("fn,expected", CASES, ids=[f.__name__ for f, _ in CASES])
def test_fused_only_where_provable_and_bytes_unchanged(fn, expected):
    stock, fused, count = _run_pass(fn, *INPUTS)
    assert count == expected
    targets = [str(n.target) for n in fused.graph.nodes if n.op == "call_function"]
    assert targets.count("aten.cat.out") == expected
    _same(stock, fused, *INPUTS)


def test_a_composite_that_may_return_its_input_is_not_a_fresh_piece():
    """``dropout`` in eval hands back its input: here a view of the destination, which a fused cat would
    read while writing (the stock cat reads it whole first). ``linear`` always allocates."""
    def overlapping(d, x, y):
        p = torch.nn.functional.dropout(d[:, 1:3], 0.5, training=False)
        d[:, :4].copy_(torch.cat([p, y * 2], 1))
        return y + 1

    def through_linear(d, x, y):
        w = torch.ones(5, 5)
        d[:, :4].copy_(torch.cat([torch.nn.functional.linear(d[:, 1:3], w), y * 2], 1))
        return y + 1

    for fn, expected in ((overlapping, 0), (through_linear, 1)):
        stock, fused, count = _run_pass(fn, *INPUTS, pre_dispatch=True)
        assert count == expected, fn.__name__
        _same(stock, fused, *INPUTS)


def test_a_fused_store_writes_the_destination_in_place():
    def fresh(d, x, y):
        d.copy_(torch.cat([x * 2, y + 1], 1))
        return d.sum()

    _stock, fused, count = _run_pass(fresh, *INPUTS)
    assert count == 1
    d = INPUTS[0].clone()
    ptr = d.data_ptr()
    fused(d, *INPUTS[1:])
    assert d.data_ptr() == ptr and torch.equal(d, torch.cat([INPUTS[1] * 2, INPUTS[2] + 1], 1))


# --------------------------------------------------------------------------- generated stores
_FRESH_KINDS = ("fresh", "slice_of_fresh", "layer_norm")  # pieces the pass may take as new memory
_KINDS = _FRESH_KINDS + ("input", "dst_view", "dropout_of_dst_view")


@st.composite
def stores(draw):
    """A store ``dst.copy_(cat(pieces, dim))`` into a 3-D buffer: piece kinds, cat dim, destination
    (the whole buffer or a window of it), and optionally an in-place write between the cat and the copy."""
    dim = draw(st.integers(0, 2))
    kinds = draw(st.lists(st.sampled_from(_KINDS), min_size=1, max_size=3))
    sizes = [draw(st.integers(1, 3)) for _ in kinds]
    extra = draw(st.integers(0, 3))  # buffer positions past the window along dim
    offset = draw(st.integers(0, extra))
    between = draw(st.sampled_from([None, "other", "piece"]))
    return dim, kinds, sizes, extra, offset, between, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(stores())
def test_generated_stores_fuse_exactly_when_provable(case):
    dim, kinds, sizes, extra, offset, between, seed = case
    base = [2, 3, 4]
    total = sum(sizes)
    d_shape = list(base)
    d_shape[dim] = total + extra
    x_shape = list(base)
    x_shape[dim] = max(sizes) + 1
    g = torch.Generator().manual_seed(seed)
    inputs = (torch.randn(d_shape, generator=g), torch.randn(x_shape, generator=g), torch.randn(2, 2, generator=g))

    def fn(d, x, other):
        pieces, roots, at = [], [], 0
        for kind, s in zip(kinds, sizes):
            if kind == "fresh":
                t = x.narrow(dim, 0, s) * 2
                pieces.append(t)
                roots.append(t)
            elif kind == "slice_of_fresh":
                u = x * 3
                pieces.append(u.narrow(dim, 1, s))
                roots.append(u)
            elif kind == "layer_norm":
                t = torch.nn.functional.layer_norm(x.narrow(dim, 0, s), (x.narrow(dim, 0, s).shape[-1],))
                pieces.append(t)
                roots.append(t)
            elif kind == "input":
                pieces.append(x.narrow(dim, 0, s))
            else:  # a window of the buffer itself, possibly overlapping the destination
                v = d.narrow(dim, at % (d.shape[dim] - s + 1), s)
                pieces.append(torch.nn.functional.dropout(v, 0.5, training=False) if kind == "dropout_of_dst_view"
                              else v)
            at += s
        c = torch.cat(pieces, dim)
        if between == "other":
            other.add_(1)
        elif between == "piece" and roots:
            roots[0].add_(1)
        d.narrow(dim, offset, total).copy_(c)
        return other * 1

    provable = all(k in _FRESH_KINDS for k in kinds) and not (between == "piece")
    stock, fused, count = _run_pass(fn, *inputs, pre_dispatch=True)
    assert count == int(provable), (kinds, between)
    _same(stock, fused, *inputs)
