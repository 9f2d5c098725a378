"""CPU tests of ExactShapeReplay's admission logic and counters, through FakeBackend."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence_fx.determinism import (NotReproducibleError, check_reproducible, envelope,
                                    pin_envelope, sha256_tensors)
from cadence_fx.runtime.backends import CudaGraphBackend
from cadence_fx.runtime.exact_replay import ExactShapeReplay
from cadence_fx.testing.fake_backend import FakeBackend


def affine(x, w, b):
    return torch.tanh(x @ w + b), (x * 2).sum(-1)


def engine(fn, **kw):
    kw.setdefault("backend", FakeBackend())
    kw.setdefault("name", getattr(fn, "__name__", type(fn).__name__))
    return ExactShapeReplay(fn, **kw)


def args(n=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(d, d, generator=g), torch.randn(d, generator=g)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
        return
    assert type(a) is type(b) and len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


# -- keying --------------------------------------------------------------------------

def test_signature_keys_shape_stride_dtype_and_scalars():
    e = engine(affine)
    x, w, b = args()
    k = e.signature((x, w, b))
    assert k == e.signature((x.clone(), w.clone(), b.clone()))
    assert k != e.signature((x[:3], w, b))                      # shape
    assert k != e.signature((x.t().contiguous().t(), w, b))     # stride (column-major)
    assert k != e.signature((x.double(), w, b))                 # dtype
    assert e.signature((x, 2)) != e.signature((x, 3))
    assert e.signature((x, 1)) != e.signature((x, True))        # type is part of a scalar's key
    assert e.signature((x, 0.0)) != e.signature((x, -0.0))      # float keys are exact bits
    assert e.signature((x, None, "mode")) == e.signature((x, None, "mode"))
    hash(k)


def test_signature_reads_no_data_and_refuses_what_it_cannot_key():
    e = engine(affine)
    x, w, b = args()
    assert e.signature((x, object())) is None
    assert e.signature((x, [1, 2])) is None
    assert e.signature((x, x)) is None  # a staged copy would break the aliasing between them
    with torch.device("meta"):
        m = torch.empty(3, 4)
    assert e.signature((m,)) is not None  # meta tensors have no data: keying must not read any


def test_unkeyable_argument_runs_eager_and_is_counted():
    seen = []

    def fn(x, tag):
        seen.append(tag)
        return x + 1

    e = engine(fn)
    x = torch.zeros(3)
    out = e(x, object())
    assert torch.equal(out, x + 1)
    assert e.counters.eager == 1 and e.counters.rejections["unkeyable_argument"] == 1
    assert e.counters.replays == 0


# -- capture and replay ------------------------------------------------------------------

def test_capture_then_replay_is_equal_to_eager():
    fake = FakeBackend()
    e = engine(affine, backend=fake)
    report = e.capture(*args())
    assert report.admitted and report.effect == "pure" and report.key in e.classes
    for seed in range(20):
        a = args(seed=seed)
        assert_same(e(*a), affine(*a))
    assert e.counters.replays == 20 and e.counters.eager == 0 and fake.replays == 20
    assert e.counters.captures == 1 and fake.captures == 1
    assert e.capture(*args(seed=99)) is report  # same class: not captured again


def test_outputs_are_cloned_so_the_next_replay_does_not_overwrite_them():
    e = engine(affine)
    e.capture(*args())
    first = e(*args(seed=1))
    kept = [t.clone() for t in first]
    e(*args(seed=2))
    assert_same(tuple(first), tuple(kept))


def test_signature_miss_runs_eager_and_leaves_other_classes_replaying():
    e = engine(affine)
    e.capture(*args(n=4))
    e.capture(*args(n=6))
    miss = args(n=5)
    assert_same(e(*miss), affine(*miss))
    assert e.counters.rejections["signature_miss"] == 1 and e.counters.eager == 1
    for n in (4, 6, 4):
        a = args(n=n, seed=n)
        assert_same(e(*a), affine(*a))
    assert e.counters.replays == 3 and len(e.classes) == 2


def test_staging_copies_non_aliased_arguments():
    e = engine(affine)
    x, w, b = args()
    e.capture(x, w, b)
    for i in range(5):
        x.add_(1.0)    # the caller reuses and mutates its own tensors between calls
        w.mul_(0.5)
        assert_same(e(x, w, b), affine(x, w, b))
    report = next(iter(e.classes.values()))
    assert report.staging_bytes >= (x.numel() + w.numel() + b.numel()) * 4


def test_expanded_argument_is_staged_by_its_storage_span():
    def fn(x, y):
        return x * y

    e = engine(fn)
    base = torch.randn(8)
    y = torch.randn(4, 8)
    assert e.capture(base.expand(4, 8), y).admitted
    base.copy_(torch.randn(8))
    assert torch.equal(e(base.expand(4, 8), y), base.expand(4, 8) * y)
    assert e.counters.replays == 1


def test_in_place_write_to_a_staged_argument_is_written_back():
    def fn(x, y):
        x.add_(y)
        return x * 2

    e = engine(fn)
    x, y = torch.randn(5), torch.randn(5)
    before = x.clone()
    report = e.capture(x, y)
    assert torch.equal(x, before)  # probe invisible
    assert report.copy_back == (0,)
    ref_x = x.clone()
    ref_out = fn(ref_x, y)
    out = e(x, y)
    assert torch.equal(out, ref_out) and torch.equal(x, ref_x)


# -- aliased buffers and pointer drift -------------------------------------------------------

def writeback(cache, x, pos):
    cache[pos: pos + x.shape[0]].copy_(x * 3)
    return cache[: pos + x.shape[0]], x.sum()


def test_aliased_buffer_is_written_in_place_and_view_outputs_are_not_cloned():
    e = engine(writeback, aliased=(0,))
    cache = torch.zeros(16)
    report = e.capture(cache, torch.ones(4), 2)
    assert report.aliased_ptrs == {0: cache.data_ptr()}
    assert torch.equal(cache, torch.zeros(16))  # capture left the buffer as found
    x = torch.randn(4)
    view, total = e(cache, x, 2)
    ref = torch.zeros(16)
    ref_view, ref_total = writeback(ref, x, 2)
    assert torch.equal(cache, ref) and torch.equal(view, ref_view) and torch.equal(total, ref_total)
    assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert e.counters.replays == 1


class HeldCache(torch.nn.Module):
    """A cache in a module buffer: the call returns a view of it (as a partition returns a view of a region
    bound as its attribute) and a view of its read-only input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 6))

    def forward(self, x):
        return self.cache[1:3], x[:, 1:].t(), (x * 2).sum()


@pytest.mark.parametrize("arena", [False, True])
def test_outputs_viewing_held_or_read_only_argument_memory_alias_it_as_eager(arena):
    """An output viewing a buffer the callable holds is that buffer's view, not a clone; an output viewing
    a staged (read-only) argument is the same view of the caller's argument, not of the staging buffer.
    A later in-place write through either reaches the memory it reaches eagerly."""
    from cadence_fx.runtime.staging import StagingArena

    m = HeldCache()
    e = engine(m, name="held", arena=StagingArena() if arena else None)
    x0 = torch.randn(6, 5)
    assert e.capture(x0.clone()).admitted
    for k in range(3):
        x = torch.randn(6, 5)
        held, window, total = e(x)
        assert e.counters.replays == k + 1
        ref_held, ref_window, ref_total = m.cache[1:3], x[:, 1:].t(), (x * 2).sum()
        for got, ref in ((held, ref_held), (window, ref_window)):
            assert got.data_ptr() == ref.data_ptr() and got.stride() == ref.stride() and torch.equal(got, ref)
        assert torch.equal(total, ref_total) and total.data_ptr() != ref_total.data_ptr()
        before = x[:, 1:].clone()
        held.add_(1.0)  # what a journal or a ring write in the next partition does
        window.mul_(-1.0)
        assert torch.equal(m.cache[1:3], torch.full((2, 6), float(k + 1))) and torch.equal(x[:, 1:], -before)


def test_an_output_no_view_of_the_callers_argument_gives_is_not_captured():
    """A dtype view of a staged argument cannot be handed back as eager hands it: the class is refused,
    counted, and its calls run eagerly."""
    def bits(x):
        return x.view(torch.int32), x + 1

    e = engine(bits)
    x = torch.randn(4, 4)
    report = e.capture(x)
    assert not report.admitted and report.reason == "capture_failed" and "views staged argument 0" in report.error
    out, _ = e(x)
    assert out.data_ptr() == x.data_ptr() and e.counters.rejections["capture_failed"] == 1


def test_pointer_drift_invalidates_only_that_class():
    e = engine(writeback, aliased=(0,))
    cache_a, cache_b = torch.zeros(16), torch.zeros(32)
    e.capture(cache_a, torch.ones(4), 0)
    key_b = e.capture(cache_b, torch.ones(4), 0).key
    moved = torch.zeros(16)  # same signature as cache_a, different address
    x = torch.randn(4)
    view, _ = e(moved, x, 0)
    assert torch.equal(moved[:4], x * 3) and torch.equal(view, moved[:4])  # still correct
    assert e.counters.invalidations == 1 and e.counters.rejections["pointer_drift"] == 1
    assert list(e.classes) == [key_b]
    e(cache_b, x, 0)                               # the other class keeps replaying
    assert e.counters.replays == 1 and torch.equal(cache_b[:4], x * 3)
    e(cache_a, x, 0)                               # the dropped class stays dropped ...
    assert e.counters.rejections["invalidated"] == 1
    assert e.capture(moved, x, 0).admitted         # ... until it is captured again
    e(moved, torch.ones(4), 0)
    assert e.counters.replays == 2


def test_fresh_view_of_the_same_storage_is_not_drift():
    e = engine(writeback, aliased=(0,))
    storage = torch.zeros(16)
    e.capture(storage[:], torch.ones(4), 0)
    e(storage.view(16), torch.ones(4), 0)
    assert e.counters.replays == 1 and e.counters.invalidations == 0


def test_explicit_invalidate():
    e = engine(affine)
    key = e.capture(*args()).key
    e.invalidate(key)
    e(*args())
    assert e.counters.invalidations == 1 and e.counters.rejections["invalidated"] == 1
    e.capture(*args())
    e.invalidate()
    assert e.classes == {} and e.counters.invalidations == 2


# -- effects ---------------------------------------------------------------------------------

def test_probe_and_capture_are_invisible():
    np = pytest.importorskip("numpy")
    fake = FakeBackend(seed=7)

    def rng_snapshot(fake):
        return (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(),
                fake.device_rng_get())

    def fn(cache, x):
        noise = torch.rand(x.shape, generator=fake.generator)
        cache.add_(x)
        return cache * noise

    e = engine(fn, aliased=(0,), backend=fake)
    cache, x = torch.randn(6), torch.randn(6)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    before, cache_before, x_before = rng_snapshot(fake), cache.clone(), x.clone()
    report = e.capture(cache, x)
    after = rng_snapshot(fake)
    assert report.admitted and report.effect == "device_rng"
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert np.array_equal(before[2], after[2]) and torch.equal(before[3], after[3])
    assert torch.equal(cache, cache_before) and torch.equal(x, x_before)


def test_host_randomness_is_rejected_for_good():
    def fn(x):
        return x + torch.rand(x.shape)  # global CPU generator: host randomness

    fake = FakeBackend()
    e = engine(fn, backend=fake)
    x = torch.zeros(4)
    state = torch.get_rng_state()
    report = e.capture(x)
    assert not report.admitted and report.reason == "host_randomness"
    assert torch.equal(state, torch.get_rng_state()) and fake.captures == 0
    for _ in range(3):
        torch.manual_seed(5)
        out = e(x)
        torch.manual_seed(5)
        assert torch.equal(out, fn(x))
    assert e.counters.rejections["host_randomness"] == 3 and e.counters.replays == 0
    assert e.capture(x).reason == "host_randomness" and e.classes == {}


def test_python_and_numpy_random_count_as_host_randomness():
    e = engine(lambda x: x * random.random())
    assert e.capture(torch.ones(2)).reason == "host_randomness"
    np = pytest.importorskip("numpy")
    e = engine(lambda x: x * float(np.random.rand()))
    assert e.capture(torch.ones(2)).reason == "host_randomness"


def test_parameters_are_keyed_like_tensors():
    lin = torch.nn.Linear(8, 8)

    def fn(x, w, b):
        return torch.nn.functional.linear(x, w, b)

    e = engine(fn)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert e.capture(x, lin.weight, lin.bias).admitted
        assert torch.equal(e(x, lin.weight, lin.bias), fn(x, lin.weight, lin.bias))
    assert e.counters.replays == 1


def test_capture_refuses_while_autograd_records():
    lin = torch.nn.Linear(4, 4)
    e = engine(lambda x, w: x @ w)
    report = e.capture(torch.randn(2, 4), lin.weight)
    assert report.reason == "capture_failed" and "autograd" in report.error


def test_device_randomness_is_admitted_and_replay_draws_what_eager_draws():
    fake = FakeBackend()

    def fn(x):
        return x * torch.rand(x.shape, generator=fake.generator) + torch.randn(x.shape, generator=fake.generator)

    e = engine(fn, backend=fake)
    x = torch.randn(16)
    assert e.capture(x).effect == "device_rng"
    fake.generator.manual_seed(11)
    replayed = [e(x) for _ in range(10)]
    state_replayed = fake.device_rng_get()
    fake.generator.manual_seed(11)
    eager = [fn(x) for _ in range(10)]
    assert sha256_tensors(replayed) == sha256_tensors(eager)
    assert torch.equal(state_replayed, fake.device_rng_get()) and e.counters.replays == 10


# -- failures never crash ------------------------------------------------------------------------

def test_no_backend_runs_eager_counted():
    class Absent(FakeBackend):
        def available(self):
            return False

    e = engine(affine, backend=Absent())
    report = e.capture(*args())
    assert not report.admitted and report.reason == "no_backend"
    assert_same(e(*args()), affine(*args()))
    assert e.counters.rejections["no_backend"] == 1 and e.counters.eager == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_default_backend_without_cuda_is_no_backend():
    e = ExactShapeReplay(affine, name="affine")
    assert isinstance(e.backend, CudaGraphBackend)
    assert_same(e(*args()), affine(*args()))
    assert e.counters.rejections["no_backend"] == 1


def test_capture_failure_is_rejected_restored_and_eager():
    fake = FakeBackend()
    fake.fail_capture = RuntimeError("operation not permitted when stream is capturing")

    def fn(cache, x):
        cache.mul_(2)
        return cache + torch.rand(x.shape, generator=fake.generator)

    e = engine(fn, aliased=(0,), backend=fake)
    cache, x = torch.ones(3), torch.ones(3)
    gen_state = fake.device_rng_get()
    report = e.capture(cache, x)
    assert report.reason == "capture_failed" and "not permitted" in report.error
    assert torch.equal(cache, torch.ones(3)) and torch.equal(gen_state, fake.device_rng_get())
    e(cache, x)
    assert e.counters.rejections["capture_failed"] == 1 and torch.equal(cache, torch.full((3,), 2.0))
    fake.fail_capture = None
    assert e.capture(cache, x).admitted  # a failed capture may be retried


def test_fn_raising_in_probe_is_capture_failed():
    def fn(x):
        raise ValueError("boom")

    e = engine(fn)
    assert e.capture(torch.ones(2)).reason == "capture_failed"


def test_unsupported_output_is_capture_failed():
    e = engine(lambda x: {"y": x})
    assert e.capture(torch.ones(2)).reason == "capture_failed"


def test_each_reason_and_key_is_logged_once(caplog):
    def fn(x, tag):
        return x * 2

    e = engine(fn)
    e.capture(torch.ones(4), 0)
    with caplog.at_level(logging.WARNING, logger="cadence_fx.replay"):
        for _ in range(3):
            e(torch.ones(5), 0)
            e(torch.ones(6), 0)
            e(torch.ones(4), object())
    misses = [r for r in caplog.records if "signature_miss" in r.getMessage()]
    unkeyable = [r for r in caplog.records if "unkeyable_argument" in r.getMessage()]
    assert len(misses) == 2 and len(unkeyable) == 1
    assert e.counters.rejections["signature_miss"] == 6
    assert all(r.name == "cadence_fx.replay" and r.levelno == logging.WARNING for r in misses)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), d=st.integers(1, 6), seed=st.integers(0, 2**16), transpose=st.booleans())
def test_replay_equals_eager_for_any_captured_shape(n, d, seed, transpose):
    e = engine(affine)
    x, w, b = args(n=n, d=d, seed=seed)
    if transpose:
        x = x.t().contiguous().t()
    e.capture(x, w, b)
    y = args(n=n, d=d, seed=seed + 1)[0]
    y = torch.empty_strided(x.shape, x.stride()).copy_(y)
    assert_same(e(y, w, b), affine(y, w, b))
    assert e.counters.replays == 1


# -- determinism helpers ----------------------------------------------------------------------------

def test_sha256_is_stable_and_layout_independent():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    d = sha256_tensors([t, None, torch.tensor([1, 2], dtype=torch.int64)])
    assert d == sha256_tensors([t.clone(), torch.tensor([1, 2])])
    assert sha256_tensors(t) == sha256_tensors(t.t().contiguous().t())
    assert sha256_tensors(t) != sha256_tensors(t + 1)
    assert sha256_tensors(torch.zeros(1)) != sha256_tensors(torch.tensor([-0.0]))
    assert len(sha256_tensors(torch.ones(2, dtype=torch.bfloat16))) == 64


def test_check_reproducible():
    x = torch.randn(8)
    assert check_reproducible(lambda: [x * 2, x.sum()], runs=3) == sha256_tensors([x * 2, x.sum()])
    calls = iter(range(10))

    def drifting():
        return torch.full((2,), float(next(calls) // 2))  # runs 0,1 agree; run 2 differs

    with pytest.raises(NotReproducibleError) as info:
        check_reproducible(drifting, runs=4)
    assert info.value.run_index == 2 and "run 2" in str(info.value)


def test_envelope_pins_and_restores():
    prev = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with envelope() as applied:
            assert applied["cudnn.deterministic"] is True and applied["cudnn.benchmark"] is False
            assert applied["deterministic_algorithms"] is False
            # cuDNN attention's results part across processes (moshi on an H200): off in the envelope
            assert applied["sdpa.cudnn_attention"] is False and not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cudnn.benchmark is True and torch.backends.cuda.cudnn_sdp_enabled()
        applied = pin_envelope()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert "torch" in applied and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev[:2]
        torch.use_deterministic_algorithms(prev[2])
        torch.backends.cuda.enable_cudnn_sdp(prev[3])


def test_capture_leaves_untouched_aliased_arguments_alone():
    """A capture with no declared write set snapshots every argument and rewinds what changed; an
    aliased weight it never wrote keeps its version counter (copying it back would make a folded
    weight look edited to the program's ``WeightsChanged`` guard), a written buffer is rewound."""
    def step(x, w, acc):
        acc.add_(x.sum())
        return x @ w

    x, w, _ = args()
    acc = torch.zeros(())
    e = engine(step, aliased=(1, 2))  # mutable=None: the write set is found by comparison
    w_version, acc_before = w._version, acc.clone()
    assert e.capture(x, w, acc).admitted
    assert w._version == w_version, "capture wrote the weight back"
    assert torch.equal(acc, acc_before), "the probe's write was not rewound"
    assert torch.equal(e(x, w, acc), x @ w) and torch.equal(acc, acc_before + x.sum())


def test_engines_sharing_an_arena_stay_exact_and_hold_the_largest_class_only():
    """Two engines (two partitions of one lane) stage into one arena: each replay loads its own
    arguments first, so interleaved calls with the callers' tensors changing between them are exact,
    and the arena holds the largest class, not the sum over classes."""
    from cadence_fx.runtime.staging import StagingArena

    arena = StagingArena()
    e1, e2 = engine(affine, arena=arena), engine(affine, arena=arena)
    big, small = args(n=16, seed=1), args(n=4, seed=2)
    assert e1.capture(*big).admitted and e2.capture(*small).admitted and e1.capture(*small).admitted
    reports = [*e1.classes.values(), *e2.classes.values()]
    assert arena.allocated == sum(r.staging_bytes for r in reports) == reports[0].staging_bytes
    for r in reports:  # where each capture's time went, summed by the cold start benchmark
        assert set(r.phase_seconds) == {"probe", "stage_and_warmup", "capture"}
        assert all(v >= 0 for v in r.phase_seconds.values()) and sum(r.phase_seconds.values()) <= r.capture_seconds
    assert arena.allocated < sum(r.staged_bytes for r in reports)
    for k in range(4):
        for e, a in ((e1, big), (e2, small), (e1, small)):
            a[0].add_(0.25 * k)  # callers change their tensors between calls
            assert_same(e(*a), affine(*a))
    assert e1.counters.replays == 8 and e2.counters.replays == 4 and e1.counters.eager == 0


def test_arena_packs_one_class_without_overlap_and_keeps_pointer_alignment():
    from cadence_fx.runtime.staging import StagingArena

    arena = StagingArena()
    base = torch.zeros(64)
    ts = [base[1:9].view(2, 4), torch.ones(3, 5, dtype=torch.float64).t(), torch.zeros(7, dtype=torch.bool),
          torch.zeros(1, 1).expand(4, 4)]
    placed, grown = arena.place(list(enumerate(ts)))
    assert grown == arena.allocated > 0
    spans = []
    for t, (static, stage) in zip(ts, placed):
        assert static.shape == t.shape and static.stride() == t.stride() and static.dtype == t.dtype
        assert static.data_ptr() % 16 == t.data_ptr() % 16
        stage.load(t)
        assert torch.equal(static, t)
        spans.append((static.data_ptr(), static.data_ptr() + stage.dst.numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    again, grown = arena.place([(0, ts[0])])  # a smaller class reuses the bytes
    assert grown == 0 and again[0][0].data_ptr() == placed[0][0].data_ptr()


def test_threads_sharing_a_backend_take_turns_at_its_shared_buffers():
    """Engines given one backend share its staging arena (and, on CUDA, its capture workspace and pool):
    calls from several threads at once are serialized by the backend, each exact."""
    import sys
    import threading

    from cadence_fx.runtime.staging import StagingArena

    backend, arena = FakeBackend(), StagingArena()
    e1 = engine(affine, backend=backend, arena=arena)
    e2 = engine(affine, backend=backend, arena=arena)
    assert e1.capture(*args(seed=1)).admitted and e2.capture(*args(seed=2)).admitted
    wrong: list[tuple[int, int]] = []

    def worker(t: int) -> None:
        for k in range(150):
            a = args(seed=100 * t + k)
            if not torch.equal((e1 if (t + k) % 2 else e2)(*a)[0], affine(*a)[0]):
                wrong.append((t, k))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: an unserialized load/replay would interleave
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert not wrong and e1.counters.replays + e2.counters.replays == 600


def test_warm_up_runs_every_eager_pass_of_a_capture_on_the_backend_stream():
    """Probe, warm-up and capture all run inside the backend's side stream: a library that keeps a
    workspace per stream (cuBLAS) then makes none on the caller's stream, which no replay would use."""

    class Tracking(FakeBackend):
        inside = 0

        def side_stream(self):
            backend = self

            class _Ctx:
                def __enter__(self):
                    backend.inside += 1

                def __exit__(self, *exc):
                    backend.inside -= 1
            return _Ctx()

        def capture(self, fn, static_args, pool):
            with self.side_stream():  # CudaGraphBackend captures on the same stream
                return super().capture(fn, static_args, pool)

    backend = Tracking()
    where: list[int] = []

    def fn(x):
        where.append(backend.inside)
        return x * 2

    eng = ExactShapeReplay(fn, name="f", backend=backend)
    eng.capture(torch.ones(3))
    assert len(where) >= 3 and all(where), where  # probe, warm-up runs and the capture itself
    n = len(where)
    assert torch.equal(eng(torch.full((3,), 2.0)), torch.full((3,), 4.0))
    assert eng.counters.replays == 1 and len(where) == n + 1  # the fake replay reruns fn
