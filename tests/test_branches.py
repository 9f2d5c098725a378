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
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import make_fx

from cadence_fx.analysis.branch_plan import _alias, plan_branches


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
    from cadence_fx.analysis.branch_plan import _pure
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


class _FakeEvent:
    log: list = []

    def record(self, stream) -> None:
        self.stream = stream
        _FakeEvent.log.append(("record", stream.index, self))


class _FakeStream:
    current = None

    def __init__(self, index: int) -> None:
        self.index = index

    def wait_event(self, event) -> None:
        _FakeEvent.log.append(("wait", self.index, event))


class _StreamCtx:
    def __init__(self, stream) -> None:
        self.stream, self.prev = stream, None

    def __enter__(self) -> None:
        self.prev, _FakeStream.current = _FakeStream.current, self.stream

    def __exit__(self, *exc) -> None:
        _FakeStream.current = self.prev


def test_the_run_follows_its_plan_stream_by_stream(monkeypatch):
    """``BranchedRun`` with streams and events faked on the CPU: every kernel runs on its planned stream,
    each planned wait is issued on the waiting stream before the kernel, for an event recorded on the
    producer's stream after the producer ran; side streams fork from stream 0 first and join at the
    output; the results are the partition's own."""
    from cadence_fx.runtime import branch_run as branches

    def f(x, state):
        a = x.sin().cos()
        b = x.exp().neg()
        state.add_(a)
        return (a * b).tanh(), state.mul(2) + b

    gm = _trace(f, torch.randn(4), torch.randn(4))
    plan = plan_branches(gm, 3)
    assert plan.streams >= 2 and plan.waits
    streams = [_FakeStream(k) for k in range(3)]
    _FakeStream.current, _FakeEvent.log = streams[0], []
    calls = iter([n for n in gm.graph.nodes if n.op == "call_function"])  # the order the run calls them
    original = branches._Interpreter.call_function

    def logged(self, target, args, kwargs):
        n = next(calls)
        assert n.target is target
        if n in plan.stream_of:  # a kernel: on the stream current while it runs
            _FakeEvent.log.append(("ran", _FakeStream.current.index, n))
        return original(self, target, args, kwargs)

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream.current)
    monkeypatch.setattr(torch.cuda, "stream", _StreamCtx)
    monkeypatch.setattr(branches._Interpreter, "call_function", logged)

    x, state = torch.randn(4), torch.randn(4)
    ref_state = state.clone()
    got = branches.BranchedRun(gm, plan, streams)(x, state)
    want = gm(x, ref_state)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(state, ref_state)

    log = _FakeEvent.log
    at = {entry[2]: i for i, entry in enumerate(log) if entry[0] == "ran"}
    assert set(at) == {n for n in plan.stream_of if n.op == "call_function"}
    for n, i in at.items():
        assert log[i][1] == plan.stream_of[n], f"{n} ran on stream {log[i][1]}"
    fork = log[0]
    assert fork[0] == "record" and fork[1] == 0
    forked = [e[1] for e in log[1:] if e[0] == "wait" and e[2] is fork[2]]
    assert sorted(forked) == [k for k in plan.used if k]
    for n, waits in plan.waits.items():
        if n.op == "output":
            continue
        for p in waits:
            rec = next(j for j, e in enumerate(log) if e[0] == "record" and j > at[p] and e[1] == plan.stream_of[p])
            assert any(e[0] == "wait" and e[1] == plan.stream_of[n] and e[2] is log[rec][2] and rec < j < at[n]
                       for j, e in enumerate(log)), f"{n} does not wait for {p}"
    joins = {e[1] for e in log[max(at.values()):] if e[0] == "wait"}
    assert joins <= {0}


def test_a_backend_refuses_fewer_than_one_stream():
    import pytest

    from cadence_fx.runtime.backends import CudaGraphBackend

    with pytest.raises(ValueError, match="branches must be >= 1"):
        CudaGraphBackend(branches=0)
    assert CudaGraphBackend(branches=3).fork().branches == 3  # every lane's backend keeps the setting


def test_a_tensor_read_on_another_stream_lives_until_the_next_barrier(monkeypatch):
    """A tensor allocated on one stream and read on another is held by the run (not ``record_stream``-ed,
    which inside a capture defers its reuse to the capture's end) until the next fence or the final join
    has been launched, and released there: the allocator cannot hand its memory to a kernel that is not
    ordered after the read."""
    from cadence_fx.runtime import branch_run as branches

    def f(x, state):
        a = x.sin().cos()
        b = x.exp().neg()
        c = (a * b).tanh()       # reads a and b: at least one of them on another stream than its own
        state.add_(c)            # a fence
        d = state.mul(2).abs()
        e = x.sigmoid().relu()
        return d + e + b

    gm = _trace(f, torch.randn(64), torch.randn(64))
    plan = plan_branches(gm, 3)
    assert plan.streams >= 2 and plan.barriers
    streams = [_FakeStream(k) for k in range(3)]
    _FakeStream.current, _FakeEvent.log = streams[0], []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream.current)
    monkeypatch.setattr(torch.cuda, "stream", _StreamCtx)
    cross: list[tuple[Node, int]] = []    # (reader, storage) read across streams, in launch order
    at_barrier: list[tuple[Node, set[int], int]] = []  # (barrier, storages held when it launched, reads so far)
    original = branches._Interpreter.run_node

    def run_node(self, n):
        if n in plan.barriers:
            at_barrier.append((n, {t.untyped_storage().data_ptr() for t in self.held}, len(cross)))
        if n in plan.stream_of and n.op == "call_function":
            for a in n.all_input_nodes:
                ptr = self.env[a].untyped_storage().data_ptr() if isinstance(self.env.get(a), torch.Tensor) else 0
                if self.made_on.get(ptr, plan.stream_of[n]) != plan.stream_of[n]:
                    cross.append((n, ptr))
        out = original(self, n)
        if n in plan.barriers:
            assert self.held == [], "a barrier releases what it ordered"
        return out

    monkeypatch.setattr(branches._Interpreter, "run_node", run_node)
    x, state = torch.randn(64), torch.randn(64)
    ref = state.clone()
    got = branches.BranchedRun(gm, plan, streams)(x, state)
    assert torch.equal(got[0], gm(x, ref)[0])
    assert cross, "the plan reads nothing across streams: the test says nothing"
    for i, (reader, ptr) in enumerate(cross):
        barrier = next(b for b in at_barrier if b[2] > i)   # the first barrier launched after this read
        assert ptr in barrier[1], f"{reader} read storage {ptr:#x} across streams, released before {barrier[0]}"


def test_an_eval_mode_dropout_and_an_attention_without_dropout_are_kernels_not_fences():
    """Seeded ops whose literal arguments make them draw nothing (``dropout`` with ``train=False`` or
    ``p == 0``; SDPA with ``dropout_p == 0``, as models in eval mode export them) are scheduled like any
    pure op; a dropout that draws stays a fence on the capture stream."""
    from cadence_fx.analysis.ops import draws

    aten = torch.ops.aten

    def f(x, q):  # ATen ops spelled out: symbolic tracing keeps them as they are written
        a = aten.dropout.default(aten.sin.default(x), 0.1, False)
        b = aten.dropout.default(aten.cos.default(x), p=0.0, train=True)
        att = aten.scaled_dot_product_attention.default(q, aten.exp.default(q), aten.neg.default(q))
        live = aten.dropout.default(aten.tanh.default(x), 0.1, True)
        return aten.add.Tensor(a, b), att, live

    gm = torch.fx.symbolic_trace(f)
    seeded = [n for n in gm.graph.nodes if "dropout" in str(n.target) or "scaled_dot" in str(n.target)]
    assert [draws(n) for n in seeded] == [False, False, False, True]
    plan = plan_branches(gm, 3)
    check_plan(gm, plan)
    assert plan.fences == 1 and plan.stream_of[seeded[-1]] == 0  # only the live dropout
    assert plan.moved > 0
    x, q = torch.randn(8), torch.randn(1, 2, 4, 8)
    assert all(torch.equal(a, b) for a, b in zip(gm(x, q)[:2], f(x, q)[:2]))


def test_matrix_products_stay_on_the_first_blas_streams():
    """``blas_streams=k``: every cuBLAS call (mm, addmm, bmm, linear, SDPA...) is placed on one of the
    first k streams, so the process keeps k cuBLAS workspaces; the other kernels may use every stream."""
    from cadence_fx.analysis.branch_plan import _uses_blas

    def f(x, w):
        q, k, v = x @ w, (x + 1) @ w, (x - 1) @ w
        return q.sin() + k.cos() + v.exp() + x.tanh() + x.sigmoid().neg()

    gm = _trace(f, torch.randn(4, 4), torch.randn(4, 4))
    free = plan_branches(gm, 3)
    assert {free.stream_of[n] for n in free.stream_of if _uses_blas(n)} == {0, 1, 2}
    for k in (1, 2):
        plan = plan_branches(gm, 3, blas_streams=k)
        check_plan(gm, plan)
        assert {plan.stream_of[n] for n in plan.stream_of if _uses_blas(n)} == set(range(k))
        assert plan.streams == 3  # the pointwise chains still spread
    import pytest

    from cadence_fx.runtime.backends import CudaGraphBackend

    with pytest.raises(ValueError, match="blas_streams must be in 1..branches"):
        CudaGraphBackend(branches=2, blas_streams=3)
    assert CudaGraphBackend(branches=3, blas_streams=2).fork().blas_streams == 2


def test_an_op_draws_says_draws_nothing_leaves_the_generator_untouched():
    """The predicate against the ops themselves (CPU generator): wherever ``draws`` says an op draws
    nothing, running it leaves the generator's state as it was, for every dropout variant and SDPA over
    a grid of ``p`` and ``train``; where the op does move the generator, ``draws`` says it draws."""
    from cadence_fx.analysis.ops import draws

    aten = torch.ops.aten
    x = torch.randn(2, 3, 8, 8)
    cases = [(op, (x, p, train)) for op in (aten.dropout.default, aten.feature_dropout.default,
                                            aten.alpha_dropout.default, aten.feature_alpha_dropout.default)
             for p in (0.0, 0, 0.3, 1.0) for train in (False, True)]
    cases += [(aten.scaled_dot_product_attention.default, (x, x, x, None, p)) for p in (0.0, 0.2)]
    cases += [(aten._scaled_dot_product_flash_attention_for_cpu.default, (x, x, x, 0.0))]  # no dropout on CPU
    moved = 0
    for op, args in cases:
        g = torch.fx.Graph()
        node = g.call_function(op, tuple(g.placeholder(f"a{i}") if isinstance(a, torch.Tensor) else a
                                         for i, a in enumerate(args)))
        before = torch.get_rng_state()
        op(*args)
        changed = not torch.equal(before, torch.get_rng_state())
        moved += changed
        assert draws(node) or not changed, f"{op} {args[1:]} drew although draws() said it does not"
    assert moved >= 5  # the grid has ops that do draw: the check above is not vacuous


def test_the_fused_attention_kernels_of_a_gpu_export_draw_only_with_dropout() -> None:
    """An export on a GPU holds the kernel SDPA dispatched to (in half precision flash attention, where
    the CPU's export keeps SDPA): each is seeded, and each draws only for a ``dropout_p`` that is not a
    literal 0, found by its schema's position or by name, or its default when left out. A float16
    Token2Wav marked its 10 flow-estimator graphs as drawing through these, and took the draws' lock 11
    times a chunk."""
    from cadence_fx.analysis.ops import draws, is_random

    aten = torch.ops.aten
    fused = [aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_fused_attention_overrideable.default, aten._flash_attention_forward.default,
             aten._efficient_attention_forward.default]
    for op in fused:
        args = op._schema.arguments
        where = next(i for i, a in enumerate(args) if a.name == "dropout_p")
        for p, expect in ((0.0, False), (0, False), (0.1, True)):
            for by_name in (False, True):
                g = torch.fx.Graph()
                lead = tuple(g.placeholder(f"a{i}") for i in range(where))
                node = (g.call_function(op, lead, {"dropout_p": p}) if by_name
                        else g.call_function(op, lead + (p,)))
                assert is_random(node) and draws(node) is expect, (op, p, by_name)
        g = torch.fx.Graph()
        ph = g.placeholder("p")
        runtime_p = g.call_function(op, tuple(g.placeholder(f"a{i}") for i in range(where)) + (ph,))
        assert draws(runtime_p), f"{op}: a dropout_p known only at run time may draw"
        if args[where].has_default_value():
            g = torch.fx.Graph()
            left_out = g.call_function(op, tuple(g.placeholder(f"a{i}") for i in range(where)))
            assert draws(left_out) is not _zero_default(args[where].default_value), op


def _zero_default(value: object) -> bool:
    return isinstance(value, (int, float)) and value == 0


def test_auto_replay_branches_a_one_lane_program_only(monkeypatch) -> None:
    """``replay="auto"``: a one-lane program's graphs get branch streams (a lone call's latency), a
    program of several lanes one stream per graph (the lanes fill the GPU; the branches' fences cost
    more there); with no CUDA, no backend; a backend given is used as given."""
    from cadence_fx.build import AUTO_BLAS_STREAMS, AUTO_BRANCHES, pick_backend
    from cadence_fx.runtime.backends import CudaGraphBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    one = pick_backend("auto", 1)
    assert (one.branches, one.blas_streams) == (AUTO_BRANCHES, AUTO_BLAS_STREAMS) and AUTO_BRANCHES > 1
    assert AUTO_BLAS_STREAMS is None or 1 <= AUTO_BLAS_STREAMS <= AUTO_BRANCHES
    many = pick_backend("auto", 8)
    assert (many.branches, many.blas_streams) == (1, None)
    assert many.fork().branches == 1 and one.fork().branches == AUTO_BRANCHES  # lanes fork the setting
    mine = CudaGraphBackend(branches=1)
    assert pick_backend(mine, 1) is mine and pick_backend("off", 1) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_backend("auto", 1) is None
