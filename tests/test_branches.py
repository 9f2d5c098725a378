"""``plan_branches``: the stream plan of a partition keeps every dependency and every fence.

The plan is checked by replaying its order as the device would see it (vector clocks over the streams,
each wait an edge): every kernel starts after every kernel whose output it reads, everything that
writes memory or draws is ordered after everything launched before it and before everything after
it, and the output waits for every stream. Random dataflow graphs (pure ops, in-place writes of an
input, draws) come from Hypothesis; the replay of a branched capture on the GPU is in
``test_replay_cuda.py``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from cadence_fx.branches import _alias, plan_branches


def _kernel_producers(n, kernel_of):
    out = set()
    for a in n.all_input_nodes:
        out |= kernel_of.get(a, set())
    return out


def check_plan(gm, plan) -> None:
    """Assert that the plan's waits order every read after its producer and every fence totally."""
    streams = max(plan.streams, 1)
    pos, clock, last = {}, {}, [None] * streams
    count = [0] * streams
    kernel_of: dict = {}
    order = []
    fences = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            kernel_of[n] = set()
            continue
        if n.op != "output" and _alias(n):
            kernel_of[n] = _kernel_producers(n, kernel_of)
            continue
        s = plan.stream_of.get(n, 0)
        vc = list(clock[last[s]]) if last[s] is not None else [-1] * streams
        for p in plan.waits.get(n, ()):
            assert p in plan.recorded, f"{n} waits for {p}, which records no event"
            vc = [max(a, b) for a, b in zip(vc, clock[p])]
        pos[n] = count[s]
        vc[s] = pos[n]
        clock[n] = vc
        count[s] += 1
        last[s] = n
        for p in _kernel_producers(n, kernel_of):
            ps = plan.stream_of.get(p, 0)
            assert clock[n][ps] >= pos[p] and (ps != s or pos[p] < pos[n]), f"{n} may start before {p} ends"
        if n.op == "output":
            for k in range(streams):
                assert last[k] is None or clock[n][k] >= pos[last[k]], f"stream {k} does not join the output"
            # every stream that forks from the capture stream has work, which the output joins
            assert set(plan.used) == {0} | {k for k in range(streams) if last[k] is not None}
            break
        kernel_of[n] = {n}
        order.append(n)
        if plan.stream_of.get(n, 0) == 0 and not _pure_in(plan, n):
            fences.append(n)
    index = {n: i for i, n in enumerate(order)}
    for f in fences:
        for m in order:
            if m is f:
                continue
            a, b = (m, f) if index[m] < index[f] else (f, m)
            assert clock[b][plan.stream_of.get(a, 0)] >= pos[a], f"fence {f} not ordered with {m}"


def _pure_in(plan, n) -> bool:
    from cadence_fx.branches import _pure
    return _pure(n)


def _trace(fn, *inputs):
    return make_fx(fn)(*inputs)


def test_three_independent_chains_run_on_three_streams_and_join_at_the_sum():
    def f(x):
        a = x.sin().cos().exp()
        b = x.neg().abs().sqrt()
        c = x.tanh().sigmoid().relu()
        return a + b + c

    gm = _trace(f, torch.randn(4))
    plan = plan_branches(gm, 3)
    check_plan(gm, plan)
    assert plan.streams == 3 and plan.fences == 0 and plan.moved >= 6
    chains = [{plan.stream_of[n] for n in gm.graph.nodes if n.op == "call_function" and
               any(str(n.target).startswith(f"aten.{op}") for op in ops)}
              for ops in (("sin", "cos", "exp"), ("neg", "abs", "sqrt"), ("tanh", "sigmoid", "relu"))]
    assert all(len(c) == 1 for c in chains) and len(set.union(*chains)) == 3  # each chain on one stream
    assert plan_branches(gm, 1).streams == 1 and not plan_branches(gm, 1).stream_of


def test_an_in_place_write_is_a_fence_on_the_capture_stream():
    def f(x, state):
        a = x.sin().cos()
        b = x.exp().neg()
        state.add_(a)           # writes an input: everything before it is done, nothing after it starts early
        c = state.mul(2).abs()
        d = x.tanh().relu()
        return c + d + b

    gm = _trace(f, torch.randn(4), torch.randn(4))
    plan = plan_branches(gm, 3)
    check_plan(gm, plan)
    add = next(n for n in gm.graph.nodes if str(n.target) == "aten.add_.Tensor")
    assert plan.stream_of[add] == 0 and plan.fences == 1 and plan.streams >= 2


def test_a_draw_stays_on_the_capture_stream():
    def f(x):
        a = x.sin().cos()
        noise = torch.rand_like(x)
        return a + noise.exp()

    gm = _trace(f, torch.randn(4))
    plan = plan_branches(gm, 2)
    check_plan(gm, plan)
    rand = next(n for n in gm.graph.nodes if "rand" in str(n.target))
    assert plan.stream_of[rand] == 0


_UNARY = ("sin", "cos", "exp", "neg", "abs", "tanh", "sigmoid", "relu")


@st.composite
def _programs(draw):
    """A random straight-line program over two inputs: unary and binary pure ops, views, reshapes and
    in-place writes of the second input, in any dataflow shape."""
    steps = draw(st.lists(st.tuples(st.sampled_from(("unary", "binary", "view", "reshape", "write")),
                                    st.integers(0, 10 ** 6), st.integers(0, 10 ** 6),
                                    st.sampled_from(_UNARY)), min_size=1, max_size=40))
    outs = draw(st.integers(1, 4))
    return steps, outs


def _build(steps, outs):
    def f(x, state):
        vals = [x, state]
        for kind, i, j, op in steps:
            a, b = vals[i % len(vals)], vals[j % len(vals)]
            if kind == "unary":
                vals.append(getattr(torch, op)(a))
            elif kind == "binary":
                vals.append(a + b)
            elif kind == "view":
                vals.append(a.t())
            elif kind == "reshape":  # a copy when a is not viewable (a transposed view): a kernel
                vals.append(a.reshape(4).view(2, 2))
            else:
                state.add_(a.clone() if a.untyped_storage().data_ptr() == state.untyped_storage().data_ptr() else a)
        return tuple(vals[-outs:])
    return f


@settings(max_examples=60, deadline=None)
@given(_programs(), st.integers(1, 4))
def test_every_plan_orders_every_read_after_its_producer_and_every_write_totally(program, streams):
    steps, outs = program
    gm = _trace(_build(steps, outs), torch.randn(2, 2), torch.randn(2, 2))
    plan = plan_branches(gm, streams)
    check_plan(gm, plan)
    assert plan.streams <= streams


def test_the_checker_rejects_a_plan_missing_a_wait():
    """The property above can fail: drop one wait of a valid plan and the checker finds the race."""
    import pytest

    def f(x):
        a = x.sin().cos()
        b = x.exp().neg()
        return a * b

    gm = _trace(f, torch.randn(4))
    plan = plan_branches(gm, 2)
    check_plan(gm, plan)
    n = next(n for n in plan.waits if n.op != "output")
    del plan.waits[n]
    with pytest.raises(AssertionError, match="may start before"):
        check_plan(gm, plan)
