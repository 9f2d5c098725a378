"""The Moshi stack (``moshi`` 0.2.13 from PyPI, random weights, reduced sizes) under cadence_fx, on the CPU.

One full-duplex stream per test: Mimi encodes the user's audio, ``LMGen`` samples the text token and
the model's audio codes, Mimi decodes them. The reference is the stock code as shipped (each module
keeping its own streaming state, ``LMGen.step`` returning ``None`` on the first frame); every
other run must produce the same bytes (SHA-256 over every frame's tokens and PCM, and
``torch.equal`` frame by frame). The temporal transformer's ring holds 4 frames and Mimi's 3, so a
stream of 8 frames wraps every ring (Mimi's twice).

The upstream package is found under ``$CADENCE_FX_UPSTREAM/moshi-0.2.13`` (``pip install --no-deps
--target``, see scripts/test.sh) or as an installed ``moshi``; the tests skip when neither exists.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cadence_fx as cf
from cadence_fx.adapters import moshi as mo
from cadence_fx.adapters.streaming import CatalogReference, export_step_catalog
from cadence_fx.determinism import sha256_tensors
from cadence_fx.plan import state_traffic
from cadence_fx.testing.fake_backend import FakeBackend
from tests.test_transactions import Fault

pytestmark = pytest.mark.upstream

FRAMES = 8
NAMES = ("encode", "lm", "decode")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is as fast, and a shared CI core cannot stall a
    two-thread barrier (seen: 2 ms calls taking 500 ms under load). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _upstream() -> types.SimpleNamespace:
    try:
        return mo.load_moshi()
    except mo.UpstreamNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def stack():
    """The reduced stack, its exported programs (one class per step) and the stock stream's frames."""
    up = _upstream()
    cfg = mo.MoshiConfig.reduced()
    steps = mo.build_steps(up, cfg)
    pcm = mo.user_audio(FRAMES, seed=1)
    contracts = {n: mo.moshi_contract(getattr(steps, n)) for n in NAMES}
    examples = steps.examples()
    eps = {n: export_step_catalog(getattr(steps, n), getattr(steps, n).initial_state(), [{"x": examples[n]}],
                                  contracts[n]) for n in NAMES}
    torch.manual_seed(3)
    stock = mo.stock_stream(steps, steps.initial_state(), pcm)
    return types.SimpleNamespace(up=up, cfg=cfg, steps=steps, pcm=pcm, contracts=contracts, eps=eps,
                                 examples=examples, stock=stock)


def _sha(frames: list[mo.Frame]) -> str:
    return sha256_tensors([t for f in frames for t in f.tensors()])


def _assert_same(frames: list[mo.Frame], ref: list[mo.Frame], what: str) -> None:
    assert len(frames) == len(ref)
    for k, (f, r) in enumerate(zip(frames, ref)):
        assert torch.equal(f.tokens, r.tokens), f"{what}: frame {k} tokens differ"
        assert (f.pcm is None) == (r.pcm is None), f"{what}: frame {k} has PCM on one side only"
        assert f.pcm is None or torch.equal(f.pcm, r.pcm), f"{what}: frame {k} PCM differs"
    assert _sha(frames) == _sha(ref), what


def test_stock_stream_emits_tokens_and_audio_after_the_delay(stack):
    first, later = stack.stock[0], stack.stock[1:]
    assert first.pcm is None and bool((first.tokens == -2).all())  # LMGen.step returned None
    assert all(f.pcm is not None and f.pcm.shape == (1, 1, 1920) and bool((f.tokens >= 0).all()) for f in later)
    assert len({tuple(f.tokens.flatten().tolist()) for f in later}) > 1  # sampling: frames differ
    kv = [s for s in stack.steps.lm.slots if s.field == "kv_cache"]
    assert kv and all(s.get().shape[3] == 4 for s in kv)  # the ring the stream wraps


def test_exported_programs_are_the_stock_stream(stack):
    """The steps as exported (state passed in and out, ``LMGen``'s host-side ``None`` replaced by its
    device mask) compute the stream the upstream objects compute with their own state."""
    ref = {n: CatalogReference(stack.eps[n]) for n in NAMES}
    torch.manual_seed(3)
    _assert_same(mo.step_stream(stack.steps, ref, stack.steps.initial_state(), stack.pcm), stack.stock, "exported")


@pytest.fixture(scope="module")
def progs_off(stack) -> dict[str, cf.OptimizedProgram]:
    """The state rule, no replay (the S cell): shared by the tests that stream from a foreign initial state."""
    return _optimize(stack, "off")


def _optimize(stack, replay, **kw) -> dict[str, cf.OptimizedProgram]:
    progs = {n: cf.optimize(stack.eps[n], stack.contracts[n], replay=replay, **kw) for n in NAMES}
    if replay != "off":
        for n, p in progs.items():
            step = getattr(stack.steps, n)
            p.warmup(*step.next_args({"x": stack.examples[n]}, step.initial_state()))
    return progs


@pytest.mark.parametrize("replay", ["off", "fake"])
def test_optimized_stream_is_bit_exact_with_rings_in_place(stack, progs_off, replay):
    progs = _optimize(stack, FakeBackend()) if replay == "fake" else progs_off
    before = {n: p.stats["state_in_place"] for n, p in progs.items()}
    torch.manual_seed(3)
    got = mo.step_stream(stack.steps, progs, stack.steps.initial_state(), stack.pcm)
    _assert_same(got, stack.stock, f"optimized ({replay})")
    for n in NAMES:
        prog, step = progs[n], getattr(stack.steps, n)
        calls = FRAMES - (stack.steps.max_delay if n == "decode" else 0)
        regions = len(stack.contracts[n].regions)
        # every region but the first call's was the state the previous call returned, used in place
        assert prog.stats["state_in_place"] - before[n] == regions * (calls - 1), n
        # a ring the model writes in place costs no copy into its buffer, and LMGen's frame counter
        # (replaced by torch.where every frame) is computed straight into its buffer: no copy at all
        assert prog.stats["passes"].get("retention_in_place", 0) == 0, n
        assert prog.stats["passes"].get("computed_into_region", 0) == (1 if n == "lm" else 0), n
        # so one call writes no more state bytes than the stock program (counted from both graphs)
        traffic = state_traffic(prog)[0]["regions"]
        assert sum(v["optimized"] for v in traffic.values()) == sum(v["stock"] for v in traffic.values()), n
        assert {r.name for r in stack.contracts[n].regions} <= {s.name for s in step.slots}
    if replay == "fake":
        c = {n: p.counters() for n, p in progs.items()}
        assert c["decode"]["replays"] == FRAMES - stack.steps.max_delay and c["decode"]["eager"] == 0
        assert c["encode"]["replays"] == FRAMES and c["encode"]["eager"] == 0
        # the LM samples on the host generator here (CPU): its replay is refused, fail-closed, and it runs eagerly
        assert c["lm"]["replays"] == 0 and c["lm"]["rejections"] == {"host_randomness": FRAMES}


@pytest.mark.parametrize("state", [True, False])
def test_lm_frame_replayed_whole_is_exact(stack, state):
    """The whole LM frame as one replayed partition (the SR and R cells' LM). On the CPU a replayed
    step cannot sample (host randomness is refused), so this LM samples greedily; the ring writes,
    the token bookkeeping and ``LMGen``'s masked assignment run through the (fake) replay."""
    up, cfg = stack.up, dataclasses.replace(stack.cfg, use_sampling=False)
    step = mo.LMStep(mo.build_lm_gen(up, cfg, mo.build_lm(up, cfg)), up)
    contract = mo.moshi_contract(step)
    fresh = step.fresh(FRAMES, seed=5)
    eps = export_step_catalog(step, step.initial_state(), fresh[:1], contract)
    prog = cf.optimize(eps, contract, replay=FakeBackend(), state=state)
    prog.warmup(fresh[0]["x"])
    mo.install_state(step, step.initial_state())
    with mo.upstream_eager(up), torch.no_grad():
        stock = [step.as_tokens(step.gen.step(f["x"]), 1, "cpu").clone() for f in fresh]
    got, st = [], step.initial_state()
    with torch.no_grad():
        for f in fresh:
            out = prog(*step.next_args(f, st))
            got.append(out[0].clone())
            st = step.carry(out)
    assert all(torch.equal(a, b) for a, b in zip(got, stock))
    assert prog.counters()["replays"] == FRAMES and prog.counters()["eager"] == 0


def test_state_outputs_are_views_of_the_region_buffers(stack, progs_off):
    step = stack.steps.lm
    prog = progs_off["lm"]
    state = step.initial_state()
    torch.manual_seed(3)
    for k in range(6):  # 6 frames: the 4-frame ring wraps
        out = prog(*step.next_args({"x": stack.examples["lm"]}, state))
        state = step.carry(out)
        for r in stack.contracts["lm"].regions:
            t = state[r.input]
            assert t.untyped_storage().data_ptr() == prog.region_buffers[r.name].untyped_storage().data_ptr(), r.name
    stale = dict(state)
    prog(*step.next_args({"x": stack.examples["lm"]}, state))
    with pytest.raises(cf.StaleState):  # a state kept from an older call was overwritten since
        prog(*step.next_args({"x": stack.examples["lm"]}, stale))


def test_two_sessions_interleaved_are_each_their_own_solo_run(stack, progs_off):
    progs = progs_off
    seeds = (11, 12)
    pcm = {s: mo.user_audio(6, seed=s) for s in seeds}
    sessions = {s: {n: progs[n].session(f"{n}-{s}", seed=s) for n in NAMES} for s in seeds}
    state = {s: stack.steps.initial_state() for s in seeds}
    got: dict[int, list[mo.Frame]] = {s: [] for s in seeds}
    with torch.no_grad():
        for k in range(6):
            for s in seeds:  # one frame of each conversation in turn
                f = mo.step_frame(stack.steps, sessions[s], state[s], pcm[s][k], k)
                got[s].append(mo.Frame(f.tokens.clone(), None if f.pcm is None else f.pcm.clone()))
    for s in seeds:
        torch.manual_seed(s)
        solo = mo.stock_stream(stack.steps, stack.steps.initial_state(), pcm[s])
        _assert_same(got[s], solo, f"session {s}")
    assert _sha(got[seeds[0]]) != _sha(got[seeds[1]])


class _FaultAtOp(TorchDispatchMode):
    """Raise :class:`Fault` when the ``nth`` call of aten op ``name`` (an overload packet name) begins."""

    def __init__(self, name: str, nth: int) -> None:
        super().__init__()
        self.name, self.nth, self.seen = name, nth, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == self.name:
            self.seen += 1
            if self.seen == self.nth:
                raise Fault(f"injected at {func} #{self.nth}")
        return func(*args, **(kwargs or {}))


class _FaultyFirst:
    """A program whose calls on the frames in ``at`` first raise at an op (``_FaultAtOp``), then run
    again with the same arguments: the retry."""

    def __init__(self, fn, at: set[int], op: tuple[str, int]) -> None:
        self.fn, self.at, self.op, self.k, self.fired = fn, at, op, 0, 0

    def __call__(self, *args):
        if self.k in self.at:
            kept = {n: t.clone() for n, t in self.fn.last_returned().items()}
            with pytest.raises(Fault):
                with _FaultAtOp(*self.op):
                    self.fn(*args)
            self.fired += 1
            # every region's bytes as before the call (a retry alone would not tell: it rewrites the
            # same ring slots with the same values)
            now = self.fn.last_returned()
            assert kept.keys() == now.keys() and all(torch.equal(kept[n], now[n]) for n in kept), self.op
        self.k += 1
        return self.fn(*args)


# the LM step's writes in order: the token ring, each layer's K and V ring slots, the depformer's
# draws, the token ring again (twice): a fault at its first draw comes after every KV ring write,
# one at the 7th scatter_ before the last token-ring write
@pytest.mark.parametrize("op", [("exponential_", 1), ("scatter_", 7)])
def test_pinned_sessions_undo_a_fault_after_the_ring_writes_and_stay_exact(stack, op):
    """Pinned sessions keep their rings in their lanes' buffers; a call that raises after writing
    them puts back only what it overwrote (the journal: one slot per ring), and the stream is the
    stock one."""
    progs = {n: cf.optimize(stack.eps[n], stack.contracts[n], replay="off", lanes=3, journal=True) for n in NAMES}
    seeds = (11, 12)
    pcm = {s: mo.user_audio(7, seed=s) for s in seeds}
    sessions = {s: {n: progs[n].session(f"{n}-{s}", seed=s, pin=True) for n in NAMES} for s in seeds}
    for s in seeds:
        sessions[s]["lm"] = _FaultyFirst(sessions[s]["lm"], {2, 5}, op)  # frame 5: the 4-slot ring wrapped
    journal = next(iter(progs["lm"].lanes.lanes[1].catalog.values())).facts.journal
    assert {e.kind for e in journal.entries} >= {"scatter_"}  # the rings' writes are journaled by slot
    state = {s: stack.steps.initial_state() for s in seeds}
    got: dict[int, list[mo.Frame]] = {s: [] for s in seeds}
    with torch.no_grad():
        for k in range(7):
            for s in seeds:
                f = mo.step_frame(stack.steps, sessions[s], state[s], pcm[s][k], k)
                got[s].append(mo.Frame(f.tokens.clone(), None if f.pcm is None else f.pcm.clone()))
    for s in seeds:
        assert sessions[s]["lm"].fired == 2
        torch.manual_seed(s)
        solo = mo.stock_stream(stack.steps, stack.steps.initial_state(), pcm[s])
        _assert_same(got[s], solo, f"pinned session {s}")


def test_a_state_field_the_adapter_does_not_know_is_refused(stack):
    up = stack.up

    @dataclasses.dataclass
    class _Extra(up.streaming.State):
        memory: torch.Tensor = None

    class Extra(up.streaming.StreamingModule):
        def _init_streaming_state(self, batch_size: int):
            return _Extra(batch_size, torch.device("cpu"), memory=torch.zeros(batch_size, 4))

    mod = Extra()
    with mod.streaming(1):
        with pytest.raises(mo.UnsupportedState, match=r"_Extra.memory"):
            mo.state_slots(mod, up)


def test_contract_declares_rings_counters_and_conv_contexts(stack):
    lm = {r.name: r for r in stack.contracts["lm"].regions}
    ring = lm["lm_model.transformer.layers.0.self_attn.kv_cache"]
    assert (ring.axis, ring.order, ring.retention, ring.initial) == (3, None, cf.Ring(4), 4)
    assert lm["tokens"].retention == cf.Ring(3) and lm["offsets"].axis == 0
    dec = {r.name: r for r in stack.contracts["decode"].regions}
    convs = [r for r in dec.values() if r.name.endswith(".previous")]
    assert convs and all(r.order == "old_new" for r in convs)
    enc = {r.name: r for r in stack.contracts["encode"].regions}
    assert enc["downsample.conv.previous"].order is None  # written in place before it is concatenated
    assert "downsample.conv.first" not in enc  # a bool flag: a plain input and output (see contracts.py)


def test_another_moshi_release_is_refused():
    _upstream()
    with pytest.raises(RuntimeError, match=r"written against moshi 9\.9"):
        mo.load_moshi(version="9.9")


def test_benchmark_rows_say_where_two_streams_part(stack):
    """benchmarks/moshi.py keeps every frame's tokens, a digest of its PCM and digests of the LM's input,
    KV writes, logits and sampled tokens, and reports, per cell against B0, the first frame whose tokens
    differ (which entry: text or audio codebook), the first frame whose PCM differs, and the first frame
    each digest differs."""
    from benchmarks import moshi as bm

    steps = stack.steps
    for n in NAMES:
        mo.install_state(getattr(steps, n), steps.initial_state()[n])
    mimi, gen = steps.decode.module, steps.lm.gen
    stages = {"encode": mimi.encode, "lm": lambda c: steps.lm.as_tokens(gen.step(c), 1, "cpu"), "decode": mimi.decode}
    stash = bm.stash_logits(gen)
    probe = bm.lm_probe(steps.lm, lambda: {s.name: s.get() for s in steps.lm.slots}, kv_full_every=4, stash=stash)
    try:
        with mo.upstream_eager(stack.up):
            res = bm.stream(stages, stack.pcm, steps.max_delay, "cpu", probe)
    finally:
        del gen.lm_model.forward_depformer  # the instance attribute stash_logits set: the method again
        gen.on_text_logits_hook = None
    per = 1 + gen.lm_model.dep_q
    assert len(res["frame_tokens"]) == FRAMES and all(len(t) == per for t in res["frame_tokens"])
    assert res["tokens_shape"] == [1, per] and res["frame_tokens"][0] == [-2] * per
    assert res["frame_pcm"][0] is None and all(len(d) == bm.PCM_DIGEST for d in res["frame_pcm"][1:])
    base = dict(res, name="B0")
    assert bm.describe(bm.divergence(dict(base), base)) == f"identical over {FRAMES} frames"
    # per-frame digests of the LM's input, its written KV entries (per layer), logits and sampled tokens
    dg = res["digests"]
    assert all(len(dg[k]) == FRAMES for k in bm.DIGEST_KEYS + ("kv_layers",))
    assert [k for k, v in enumerate(dg["kv_full"]) if v] == [3, 7] and len(dg["kv_layers"][0]) == 2
    assert len(dg["dep_logits"][0]) == per - 1
    # ``sampled`` is before the delays: entry i of frame k's output was sampled at frame k - max_delay + delay_i
    delays, md = gen.delays_cuda[:per].tolist(), steps.max_delay
    assert all(res["frame_tokens"][k][i] == dg["sampled"][k - md + d][i]
               for k in range(md, FRAMES) for i, d in enumerate(delays) if k - md + d < FRAMES)
    assert len(set(dg["kv"])) == FRAMES  # every frame writes new entries
    assert all(e is not None and e["first"] is None for e in bm.digest_divergence(base, base).values())
    kv_layers = [list(x) for x in dg["kv_layers"]]
    kv_layers[2][1] = "0" * bm.LAYER_DIGEST
    sampled = [list(x) for x in dg["sampled"]]
    sampled[4][2] += 1
    other = dict(base, digests=dict(dg, kv=dg["kv"][:2] + ["x"] + dg["kv"][3:], kv_layers=kv_layers, sampled=sampled,
                                    text_logits=[None] * FRAMES))
    d = bm.digest_divergence(other, base)
    assert d["kv"] == {"compared": FRAMES, "first": 2, "differ": 1, "layers": [1]}
    assert d["sampled"]["entries"] == ["audio 1"] and d["text_logits"] is None and d["codes"]["first"] is None
    assert "kv 2 layers [1]" in bm.describe_digests(d)
    tokens = [list(t) for t in res["frame_tokens"]]
    tokens[5][2] += 1  # audio codebook 1 (entry 0 is the text token)
    tokens[6][0] += 1
    pcm = list(res["frame_pcm"])
    pcm[3] = "0" * bm.PCM_DIGEST
    d = bm.divergence(dict(base, frame_tokens=tokens, frame_pcm=pcm), base)
    assert (d["first_token_frame"], d["first_token_entries"], d["token_frames_differ"]) == (5, ["audio 1"], 2)
    assert (d["first_pcm_frame"], d["pcm_frames_differ"], d["pcm_before_tokens"]) == (3, 1, True)
    no_record = {k: v for k, v in base.items() if k != "frame_tokens"}  # a row of an older benchmark
    assert bm.divergence(dict(base, frame_tokens=tokens), no_record) is None
    # and which kernels a cell's profiled frame runs more or fewer times than B0's
    got = bm.kernel_diff({"kernel_names": {"gemm": 3, "reduce": 1}}, {"kernel_names": {"gemm": 1, "fill": 2}})
    assert got == {"fill": -2, "gemm": 2, "reduce": 1}
    # the Snh cell's Mimi contracts: constants and weight cones inline
    c = mo.moshi_contract(steps.decode, hoist_constants=False, fold_weights=False)
    assert (c.hoist_constants, c.fold_weights) == (False, False) and mo.moshi_contract(steps.decode).fold_weights
