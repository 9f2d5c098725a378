"""GPU tests of ExactShapeReplay through real CUDA graphs (skipped without CUDA).

Each test prints one summary line starting with ``[replay-cuda]`` (run with ``-s``).
"""

from __future__ import annotations

import pytest
import torch

from cadence_fx.determinism import envelope, sha256_tensors
from cadence_fx.runtime.backends import CudaGraphBackend
from cadence_fx.runtime.exact_replay import ExactShapeReplay

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CALLS = 20
B, T, D = 2, 64, 256


@pytest.fixture(autouse=True)
def pinned():
    with envelope() as applied:
        yield applied
    torch.cuda.synchronize()


def dev():
    return torch.device("cuda")


def inputs(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(B, n, D, device="cuda", generator=g)


def weights(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(D, 4 * D, device="cuda", generator=g) / D**0.5,
            torch.randn(4 * D, D, device="cuda", generator=g) / (4 * D) ** 0.5)


def partition(cache, x, w1, w2, pos):
    """Matmuls and elementwise ops, with an in-place write into the aliased cache."""
    h = torch.nn.functional.gelu(x @ w1)
    y = torch.sigmoid(h @ w2) * x + x.mean(-1, keepdim=True)
    cache.narrow(1, pos, x.shape[1]).copy_(y)
    ctx = cache.narrow(1, 0, pos + x.shape[1])
    return y, torch.softmax(ctx @ ctx.transpose(1, 2), -1).sum(1), ctx


def writeback(cache, x, w1, w2):
    cache.narrow(1, 0, x.shape[1]).copy_(torch.relu(x @ w1) @ w2)
    return cache.sum(1)


def equal_all(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_deterministic_partition_bit_exact():
    w1, w2 = weights()
    cache, ref_cache = torch.zeros(B, T, D, device=dev()), torch.zeros(B, T, D, device=dev())
    e = ExactShapeReplay(partition, name="partition", aliased=(0,))
    report = e.capture(cache, inputs(16, 0), w1, w2, 8)
    assert report.admitted and report.effect == "pure", report
    assert torch.count_nonzero(cache) == 0  # warm-up writes were undone
    exact = 0
    for i in range(CALLS):
        x = inputs(16, i + 1)
        out = e(cache, x, w1, w2, 8)
        ref = partition(ref_cache, x, w1, w2, 8)
        assert equal_all(out, ref) and torch.equal(cache, ref_cache), f"call {i}"
        assert out[2].data_ptr() == cache.data_ptr()  # view of the aliased buffer, not a copy
        exact += 1
    assert e.counters.replays == CALLS and e.counters.eager == 0
    print(f"[replay-cuda] (a) deterministic partition: {exact}/{CALLS} calls bit-exact "
          f"(3 outputs + aliased buffer), replays={e.counters.replays}, "
          f"capture={report.capture_seconds:.3f}s, graph_bytes={report.graph_bytes}, "
          f"staging_bytes={report.staging_bytes}")


def noisy(x, w1, w2):
    """Device randomness drawn between other kernels."""
    h = x @ w1
    n = torch.rand(h.shape, device=h.device)
    h = torch.tanh(h) + 0.1 * n
    m = torch.randn_like(x)
    return h @ w2 + m, (n * m.mean()).sum(-1)


def test_b_device_randomness_replays_the_eager_stream():
    w1, w2 = weights()
    e = ExactShapeReplay(noisy, name="noisy")
    xs = [inputs(16, i) for i in range(CALLS)]
    torch.manual_seed(1)
    before = torch.cuda.get_rng_state()
    report = e.capture(xs[0], w1, w2)
    assert report.admitted and report.effect == "device_rng", report
    assert torch.equal(before, torch.cuda.get_rng_state())  # probe, warm-up and capture invisible

    def stream(call):
        torch.manual_seed(1234)
        outs = []
        for x in xs:
            outs.extend(call(x, w1, w2))
            outs.append(torch.rand(3, device=dev()))  # draws outside the wrapped callable too
        torch.cuda.synchronize()
        return sha256_tensors(outs), torch.cuda.get_rng_state(), outs

    eager_digest, eager_state, eager_outs = stream(noisy)
    replay_digest, replay_state, replay_outs = stream(e)
    same_calls = sum(equal_all(eager_outs[3 * i: 3 * i + 3], replay_outs[3 * i: 3 * i + 3]) for i in range(CALLS))
    assert same_calls == CALLS
    assert eager_digest == replay_digest and torch.equal(eager_state, replay_state)
    assert e.counters.replays == CALLS and e.counters.eager == 0
    assert not equal_all(eager_outs[0:2], eager_outs[3:5])  # calls did draw fresh numbers
    print(f"[replay-cuda] (b) device RNG: {same_calls}/{CALLS} calls identical, stream sha256 "
          f"{replay_digest[:16]} equal, generator state after streams equal, replays={e.counters.replays}")


def test_b2_device_randomness_with_interleaved_misses():
    w1, w2 = weights()
    e = ExactShapeReplay(noisy, name="noisy")
    assert e.capture(inputs(16, 0), w1, w2).effect == "device_rng"
    xs = [inputs(16 if i % 3 else 12, i) for i in range(CALLS)]  # every third call misses

    def stream(call):
        torch.manual_seed(99)
        outs = [t for x in xs for t in call(x, w1, w2)]
        return sha256_tensors(outs), torch.cuda.get_rng_state()

    eager_digest, eager_state = stream(noisy)
    replay_digest, replay_state = stream(e)
    assert eager_digest == replay_digest and torch.equal(eager_state, replay_state)
    c = e.counters
    assert c.replays + c.rejections["signature_miss"] == CALLS and c.rejections["signature_miss"] == 7
    print(f"[replay-cuda] (b2) device RNG, {c.replays} replays interleaved with "
          f"{c.rejections['signature_miss']} eager misses: stream sha256 {replay_digest[:16]} equal, "
          f"generator state equal")


def host_noisy(x, w1, w2):
    n = torch.rand(x.shape)                              # CPU generator: host randomness
    k = int(torch.randint(1, 4, (1,)))
    return (x + n.to(x.device)) @ w1 @ w2 * k


def test_c_host_randomness_rejected_and_eager_equal():
    w1, w2 = weights()
    e = ExactShapeReplay(host_noisy, name="host_noisy")
    x = inputs(16, 0)
    cpu_state = torch.get_rng_state()
    report = e.capture(x, w1, w2)
    assert not report.admitted and report.reason == "host_randomness"
    assert torch.equal(cpu_state, torch.get_rng_state())
    for i in range(CALLS):
        torch.manual_seed(i)
        out = e(x, w1, w2)
        torch.manual_seed(i)
        assert torch.equal(out, host_noisy(x, w1, w2)), f"call {i}"
    assert e.counters.rejections["host_randomness"] == CALLS and e.counters.replays == 0
    assert e.classes == {}
    print(f"[replay-cuda] (c) host randomness: rejected at capture, "
          f"{e.counters.rejections['host_randomness']}/{CALLS} calls eager (reason host_randomness), "
          f"all equal to eager")


def test_d_pointer_drift_invalidates_one_class_only():
    w1, w2 = weights()
    cache_a, cache_b = torch.zeros(B, T, D, device=dev()), torch.zeros(B, 2 * T, D, device=dev())
    e = ExactShapeReplay(writeback, name="writeback", aliased=(0,))
    assert e.capture(cache_a, inputs(8, 0), w1, w2).admitted
    assert e.capture(cache_b, inputs(8, 0), w1, w2).admitted
    moved = torch.zeros_like(cache_a)
    for i in range(CALLS):
        x = inputs(8, i)
        target = moved if i == CALLS // 2 else cache_a
        ref_a, ref_b = target.clone(), cache_b.clone()
        assert torch.equal(e(target, x, w1, w2), writeback(ref_a, x, w1, w2)) and torch.equal(target, ref_a)
        assert torch.equal(e(cache_b, x, w1, w2), writeback(ref_b, x, w1, w2)) and torch.equal(cache_b, ref_b)
    c = e.counters
    assert c.invalidations == 1 and c.rejections["pointer_drift"] == 1
    assert c.rejections["invalidated"] == CALLS - CALLS // 2 - 1
    assert c.replays == CALLS // 2 + CALLS  # class A until the drift, class B throughout
    assert len(e.classes) == 1
    print(f"[replay-cuda] (d) pointer drift: 1 invalidation at call {CALLS // 2}, class B replayed "
          f"{CALLS}/{CALLS}, class A eager afterwards ({c.rejections['invalidated']} invalidated misses), "
          f"all outputs and buffers equal to eager")


def test_e_out_of_catalog_signature_falls_back():
    w1, w2 = weights()
    cache, ref_cache = torch.zeros(B, T, D, device=dev()), torch.zeros(B, T, D, device=dev())
    e = ExactShapeReplay(partition, name="partition", aliased=(0,))
    assert e.capture(cache, inputs(16, 0), w1, w2, 8).admitted
    for i in range(CALLS):
        n = 16 if i % 2 == 0 else 12                    # 12: never captured
        x = inputs(n, i)
        assert equal_all(e(cache, x, w1, w2, 8), partition(ref_cache, x, w1, w2, 8))
        assert torch.equal(cache, ref_cache)
    c = e.counters
    assert c.rejections["signature_miss"] == CALLS // 2 and c.replays == CALLS // 2
    assert c.invalidations == 0 and len(e.classes) == 1
    print(f"[replay-cuda] (e) out-of-catalog: {c.rejections['signature_miss']} misses eager, "
          f"captured class replayed {c.replays}/{CALLS // 2} interleaved, all bit-exact")


def test_f_capture_failure_is_rejected_without_crashing():
    def syncing(x, w1, w2):
        scale = float(x.abs().max())                    # host sync: illegal while capturing
        return (x @ w1 @ w2) / scale

    w1, w2 = weights()
    x = inputs(16, 0)
    e = ExactShapeReplay(syncing, name="syncing")
    report = e.capture(x, w1, w2)
    assert not report.admitted and report.reason == "capture_failed"
    for i in range(3):
        x = inputs(16, i)
        assert torch.equal(e(x, w1, w2), syncing(x, w1, w2))
    # The process stays usable for graphs after the failed capture.
    ok = ExactShapeReplay(writeback, name="after_failure", aliased=(0,))
    assert ok.capture(torch.zeros(B, T, D, device=dev()), x, w1, w2).admitted
    print(f"[replay-cuda] (f) capture failure: rejected as capture_failed ({report.error[:60]}...), "
          f"eager calls equal, later captures still work")


def test_g_classes_share_one_pool_and_report_memory():
    w1, w2 = weights()
    cache = torch.zeros(B, T, D, device=dev())
    e = ExactShapeReplay(partition, name="partition", aliased=(0,))
    reports = [e.capture(cache, inputs(n, 0), w1, w2, 0) for n in (8, 16, 32)]
    assert all(r.admitted for r in reports) and e.pool is not None
    shared = ExactShapeReplay(writeback, name="shared", aliased=(0,), pool=e.pool)
    assert shared.capture(cache, inputs(8, 0), w1, w2).admitted and shared.pool is e.pool
    assert isinstance(e.backend, CudaGraphBackend)
    print("[replay-cuda] (g) shared pool: graph_bytes per class "
          + ", ".join(f"{r.graph_bytes}" for r in reports)
          + "; capture seconds " + ", ".join(f"{r.capture_seconds:.3f}" for r in reports))


def test_f2_capture_failing_after_device_draws_leaves_the_generator_usable():
    """A capture that fails mid-way after drawing device randomness: the generator and the current
    stream are recovered, later eager draws work and the stream equals a run that never captured."""
    def noisy_then_sync(x, w1, w2):
        h, s = noisy(x, w1, w2)
        return h / float(s.abs().max() + 1)             # host sync after the draws: the capture breaks

    w1, w2 = weights()
    xs = [inputs(16, i) for i in range(4)]
    e = ExactShapeReplay(noisy_then_sync, name="noisy_then_sync")
    stream0 = torch.cuda.current_stream()
    torch.manual_seed(3)
    state = torch.cuda.get_rng_state()
    report = e.capture(xs[0], w1, w2)
    assert not report.admitted and report.reason == "capture_failed"
    assert torch.cuda.current_stream() == stream0 and torch.equal(torch.cuda.get_rng_state(), state)

    def stream(call):
        torch.manual_seed(77)
        outs = [call(x, w1, w2) for x in xs] + [torch.randn(5, device=dev())]
        return sha256_tensors(outs), torch.cuda.get_rng_state()

    a, b = stream(e), stream(noisy_then_sync)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert e.counters.rejections["capture_failed"] == len(xs)
    ok = ExactShapeReplay(noisy, name="after_rng_failure")
    assert ok.capture(xs[0], w1, w2).admitted  # device-RNG graphs still capture
    print(f"[replay-cuda] (f2) capture failed after device draws ({report.error[:50]}...): stream, generator "
          f"and later captures intact")


def test_h_host_scalar_constant_is_keyed_by_value():
    def masked(x, c):
        out = x.clone()
        out[:, 0].fill_(c)                               # a 0-dim host tensor read as a scalar
        return out * 2

    x = inputs(16, 0)
    c = torch.tensor(0.25)
    e = ExactShapeReplay(masked, name="host_scalar", aliased=(1,), readonly=(1,))
    report = e.capture(x, c)
    assert report.admitted, report
    for i in range(5):
        xi = inputs(16, i)
        assert torch.equal(e(xi, c), masked(xi, c))
    assert e.counters.replays == 5
    other = torch.tensor(0.5)
    assert torch.equal(e(x, other), masked(x, other))  # another value: another class, eager
    assert e.counters.rejections["signature_miss"] == 1
    print("[replay-cuda] (h) 0-dim host constant: replayed 5/5 bit-exact, a different value is a signature miss")


def test_i_istft_inside_a_wrapped_callable_runs_between_replayed_segments():
    import cadence_fx as cf
    from tests.test_partition import Step

    torch.manual_seed(0)
    step = Step().to(dev()).eval()
    mel = torch.randn(1, 4, 12, device=dev())
    ep = torch.export.export(step, (mel,))
    prog = cf.optimize(ep, cf.Contract(clocks=(cf.Clock("frame", 12),), wrap=("vocoder",)))
    prog.warmup(mel)
    ref = ep.module()
    for k in range(10):
        x = torch.randn(1, 4, 12, device=dev())
        with torch.no_grad():
            assert torch.equal(prog(x), ref(x)), k
    c = prog.counters()
    assert c["captures"] == 2 and c["eager"] == 0 and c["replays"] >= 20, c
    print(f"[replay-cuda] (i) istft between two replayed segments: 10/10 bit-exact, counters {c}")


def test_j_captures_share_one_capture_stream_and_its_cublas_workspace():
    """Twelve graphs with a cuBLAS matmul each: one stream for all their warm-ups and captures, so
    cuBLAS keeps one workspace, not one per graph (32 MiB each on Hopper); all bit-exact."""
    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda")
    backend = CudaGraphBackend()
    engines = [ExactShapeReplay(lambda x: torch.relu(x @ w), name=f"mm{k}", backend=backend) for k in range(12)]
    xs = [torch.randn(8 + k, 256, device="cuda") for k in range(12)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for e, x in zip(engines, xs):
        assert e.capture(x).admitted
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < 2 * 32 * 2**20, f"captures kept {grown / 2**20:.0f} MiB"
    assert len(set(backend.streams())) == 1
    for e, x in zip(engines, xs):
        assert torch.equal(e(x), torch.relu(x @ w))
    print(f"[replay-cuda] (j) 12 captures, one capture stream: {grown / 2**20:.1f} MiB kept, all bit-exact")


def attention_like(cache, x, wq, wk, wv, wo, pos):
    """Three projections and their own pointwise chains, independent until the attention; then an
    in-place write of the aliased cache (a fence) and more work reading it."""
    q = torch.sin(x @ wq) * 0.5
    k = torch.cos(x @ wk).neg()
    v = torch.tanh(x @ wv)
    att = torch.softmax(q @ k.transpose(1, 2) / 16.0, -1) @ v
    cache.narrow(1, pos, x.shape[1]).copy_(att)
    ctx = cache.narrow(1, 0, pos + x.shape[1])
    return (att @ wo).relu(), (ctx @ wo).sum(1)


def test_k_branched_capture_runs_independent_chains_on_parallel_streams_bit_exact():
    """A partition (a GraphModule, as optimize hands the engine) captured with ``branches=3``: its
    projections run on three streams of one graph, the cache write is a fence; every replay equals the
    eager partition bit for bit, and the cache too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator(device="cuda").manual_seed(3)
    ws = [torch.randn(D, D, device="cuda", generator=g) / D**0.5 for _ in range(4)]
    cache, ref_cache = torch.zeros(B, T, D, device=dev()), torch.zeros(B, T, D, device=dev())
    gm = make_fx(lambda c, x, a, b, v, o: attention_like(c, x, a, b, v, o, 8))(cache.clone(), inputs(16, 0), *ws)
    backend = CudaGraphBackend(branches=3)
    e = ExactShapeReplay(gm, name="attention", aliased=(0,), backend=backend)
    report = e.capture(cache, inputs(16, 0), *ws)
    assert report.admitted, report
    plan = e.branch_plan
    assert plan is not None and plan.streams == 3 and plan.moved >= 4 and plan.fences >= 1, plan
    assert torch.count_nonzero(cache) == 0
    for i in range(CALLS):
        x = inputs(16, i + 1)
        out = e(cache, x, *ws)
        ref = attention_like(ref_cache, x, *ws, 8)
        assert equal_all(out, ref) and torch.equal(cache, ref_cache), f"call {i}"
    assert e.counters.replays == CALLS and e.counters.eager == 0
    print(f"[replay-cuda] (k) branched capture: {plan.kernels} kernels, {plan.moved} on {plan.streams - 1} side "
          f"streams, {plan.fences} fence(s); {CALLS}/{CALLS} replays bit-exact, graph_bytes={report.graph_bytes}")


def host_tensor_across_branches(x, w):
    """A host (CPU) 0-dim tensor made inside the partition and read by kernels on two streams (the Moshi
    LM step makes such scalars): a host tensor has no stream to record."""
    scale = torch.scalar_tensor(0.5)
    a = torch.sin(x @ w) * scale
    b = torch.cos(x).neg() * scale
    return a + b


def test_l_branched_capture_with_a_host_tensor_read_on_two_streams():
    from torch.fx.experimental.proxy_tensor import make_fx

    w = weights()[0][:, :D]
    gm = make_fx(host_tensor_across_branches)(inputs(16, 0), w)
    e = ExactShapeReplay(gm, name="host-scalar", backend=CudaGraphBackend(branches=2))
    report = e.capture(inputs(16, 0), w)
    assert report.admitted, report  # before the fix: capture_failed (record_stream of a CPU tensor)
    assert e.branch_plan is not None and e.branch_plan.moved >= 1
    for i in range(4):
        x = inputs(16, i + 1)
        assert torch.equal(e(x, w), host_tensor_across_branches(x, w)), f"call {i}"
    print(f"[replay-cuda] (l) host tensor across branches: captured, {e.branch_plan.moved} kernel(s) moved, bit-exact")


class _HeldCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, D, device="cuda"))

    def forward(self, x):
        return self.cache[1:3], x[0, 1:].t(), torch.tanh(x).sum()


def test_i_outputs_viewing_held_or_staged_memory_alias_it_as_eager():
    """Through real graphs: an output viewing the callable's own buffer is that buffer's view, and an
    output viewing a read-only (staged) argument is the same view of the caller's argument; in-place
    writes through them reach that memory, as eager's do."""
    m = _HeldCache()
    e = ExactShapeReplay(m, name="held", backend=CudaGraphBackend())
    assert e.capture(inputs(T, 0)).admitted
    for k in range(CALLS):
        x = inputs(T, k + 1)
        held, window, total = e(x)
        for got, ref in ((held, m.cache[1:3]), (window, x[0, 1:].t())):
            assert got.data_ptr() == ref.data_ptr() and got.stride() == ref.stride() and torch.equal(got, ref)
        assert torch.equal(total, torch.tanh(x).sum())
        before = x[0, 1:].clone()
        held.add_(1.0)
        window.mul_(-1.0)
        assert torch.equal(m.cache[1:3], torch.full((2, D), float(k + 1), device="cuda"))
        assert torch.equal(x[0, 1:], -before)
    assert e.counters.replays == CALLS and e.counters.eager == 0
    print(f"[replay-cuda] held and staged views: {CALLS} replays, aliasing as eager")
