"""``cf.propose_contract``: a contract read off a recorded stream equals the hand-written one, its code
evaluates to it, and the program optimized under it is bit-exact with the unmodified one.

Every step here is built inline and driven the way a user's driver drives it: each call's state outputs
fed back as the next call's state inputs (the recorded calls are clones, since some steps write their
inputs in place).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Callable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract

D = 8


def record(step: torch.nn.Module, state: Mapping[str, torch.Tensor], feed: Mapping[str, int],
           fresh: Callable[[int], dict], calls: int = 6) -> list[dict]:
    """A real stream: call k's ``fresh(k)`` inputs with the state fed back (``feed``: input -> output index)."""
    names = list(inspect.signature(step.forward).parameters)
    state = dict(state)
    stream = []
    with torch.no_grad():
        for k in range(calls):
            new = fresh(k)
            inputs = {n: (new[n] if n in new else state[n]) for n in names}
            stream.append({n: v.clone() for n, v in inputs.items()})
            outs = step(**inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            state.update({n: outs[j] for n, j in feed.items()})
    return stream


def frames(n: int, *, seed: int = 0, pos_of: Callable[[int], torch.Tensor] | None = None):
    """Fresh inputs per call: ``x`` of ``n`` frames (and ``pos`` when the step takes write positions)."""
    def fresh(k: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1000 + k)
        out = {"x": torch.randn(1, n, D, generator=g)}
        if pos_of is not None:
            out["pos"] = pos_of(k)
        return out
    return fresh


def proposed(step, stream, expected: cf.Contract) -> cf.Proposal:
    """The proposal equals ``expected``; its code and its printed form (code + evidence) evaluate to it."""
    p = cf.propose_contract(step, stream)
    assert p.contract == expected, str(p)
    for text in (p.code(), str(p)):
        ns: dict = {}
        exec(text, ns)  # the code a user pastes
        assert ns["contract"] == expected, text
    for r in expected.regions:
        assert p.evidence[r.name], r.name
    return p


def drive_exact(step, contract: cf.Contract, stream: list[dict], feed: Mapping[str, int], fresh, calls: int = 12,
                export=cf.export_catalog):
    """Export the catalog, optimize (no replay), drive ``calls`` calls from the stream's first state and
    compare every output with the unmodified program's by ``torch.equal``."""
    example = stream[0]
    eps = export(step, contract, example)
    ref_eps = export(copy.deepcopy(step), contract, example)  # module buffers of its own
    prog = cf.optimize(eps, contract, replay="off")
    ref = cf.reference(ref_eps)
    names = list(example)
    ref_state = {n: example[n].clone() for n in feed}
    opt_state = {n: example[n].clone() for n in feed}
    for k in range(calls):
        new = fresh(k)
        r = ref(*[(new[n] if n in new else ref_state[n]).clone() for n in names])
        o = prog(*[new[n] if n in new else opt_state[n] for n in names])
        r = r if isinstance(r, tuple) else (r,)
        o = o if isinstance(o, tuple) else (o,)
        assert len(r) == len(o)
        for j, (a, b) in enumerate(zip(r, o)):
            assert torch.equal(a, b), (k, j)
        ref_state = {n: r[j].clone() for n, j in feed.items()}
        opt_state = {n: o[j] for n, j in feed.items()}


def contract(*regions: cf.Region, stride: int) -> cf.Contract:
    return cf.Contract(clocks=(cf.Clock("frame", stride),), regions=regions, wrap=(cf.WHOLE_STEP,))


def attend(x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x @ kv.transpose(1, 2), -1) @ kv


# --- steps ------------------------------------------------------------------------------------------------------


class WindowKV(torch.nn.Module):
    """The README's quick start: ``cat([cache, new])``, attend, keep the last ``window``."""

    def __init__(self, window: int = 6, order: str = "old_new"):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.window, self.order = window, order

    def forward(self, x, cache):
        new = self.proj(x)
        kv = torch.cat([cache, new], 1) if self.order == "old_new" else torch.cat([new, cache], 1)
        return attend(x, kv), kv[:, -self.window:]


class HeadTailKV(torch.nn.Module):
    """Keeps the prompt (the first ``head`` positions) and the last ``tail`` (the Token2Wav driver's trim)."""

    def __init__(self, head: int = 4, tail: int = 6):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.head, self.tail = head, tail

    def forward(self, x, cache):
        kv = torch.cat([cache, self.proj(x)], 1)
        y = attend(x, kv)
        if kv.shape[1] > self.head + self.tail:
            kv = torch.cat([kv[:, :self.head], kv[:, -self.tail:]], 1)
        return y, kv


class ConvContext(torch.nn.Module):
    """A causal conv's left context, ``cat([ctx, x])[..., -k:]``, with a chunk longer than ``k``."""

    def __init__(self, k: int = 2):
        super().__init__()
        self.conv = torch.nn.Conv1d(D, D, k + 1)
        self.k = k

    def forward(self, x, ctx):
        ci = torch.cat([ctx, x.transpose(1, 2)], -1)
        return self.conv(ci).transpose(1, 2), ci[..., -self.k:]


class RingKV(torch.nn.Module):
    """A ring written in place at ``pos`` (Moshi-style) and read whole."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x, cache, pos):
        cache.index_copy_(1, pos, self.proj(x))
        return attend(x, cache), cache


class KVCache(torch.nn.Module):
    def __init__(self, capacity: int):
        super().__init__()
        self.register_buffer("kv", torch.zeros(1, capacity, D))


class BufferKV(torch.nn.Module):
    """A cache the step keeps in a module buffer and writes in place (gpt-fast's ``KVCache``)."""

    def __init__(self, capacity: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.cache = KVCache(capacity)

    def forward(self, x, pos):
        self.cache.kv.index_copy_(1, pos, self.proj(x))
        return attend(x, self.cache.kv)


class TwoRates(torch.nn.Module):
    """Two caches: one grows by the chunk, the other by twice it (two positions per frame)."""

    def __init__(self):
        super().__init__()
        self.pa, self.pb = torch.nn.Linear(D, D), torch.nn.Linear(D, 2 * D)

    def forward(self, x, a, b):
        ka = torch.cat([a, self.pa(x)], 1)
        kb = torch.cat([b, self.pb(x).reshape(1, 2 * x.shape[1], D)], 1)
        return attend(x, ka) + attend(x, kb), ka[:, -6:], kb[:, -8:]


class MiddleCat(torch.nn.Module):
    """The state between two parts of the new input: ``cat([a, cache, b])``."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x, cache):
        new = self.proj(x)
        kv = torch.cat([new[:, :1], cache, new[:, 1:]], 1)
        return attend(x, kv), kv[:, -6:]


# --- proposals that match the hand-written contract, then run bit-exact ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One step with one state region (input ``region.input``, output 1) and what its evidence must say."""

    make: Callable[[], torch.nn.Module]
    state: tuple[int, ...]  # the state's shape at the first call
    chunk: int
    region: cf.Region
    stride: int
    says: tuple[tuple[str, ...], ...]  # each: words one evidence sentence has together
    pos: bool = False  # the step takes the ring's write positions
    calls: int = 6


def _region(name: str, axis: int, order, retention, initial: int) -> cf.Region:
    return cf.Region(name, input=name, output=1, clock="frame", axis=axis, order=order, retention=retention,
                     initial=initial)


CASES = {
    "sliding_window": Case(WindowKV, (1, 4, D), 2, _region("cache", 1, "old_new", cf.SlidingWindow(6), 4), 2,
                           (("output 1 of call k",), ("SlidingWindow(size=6)", "last 6 positions"),
                            ("order 'old_new'", "'cat'"), ("input extents [4, 6]", "follow"))),
    "head_tail": Case(HeadTailKV, (1, 4, D), 2, _region("cache", 1, "old_new", cf.HeadTail(4, 6), 4), 2,
                      (("HeadTail(head=4, tail=6)", "prompt"),), calls=7),
    # the causal conv's context, once the chunk is longer than it: the tail of the new input alone
    "conv_context": Case(ConvContext, (1, D, 2), 5, _region("ctx", 2, "old_new", cf.SlidingWindow(2), 2), 5,
                         (("new input alone",), ("clock axis 2", "'cat'"))),
    "ring_index_copy": Case(RingKV, (1, 8, D), 2, _region("cache", 1, None, cf.Ring(8), 8), 2,
                            (("index_copy_", "order None", "[0, 1]"),), pos=True),
    "new_old": Case(lambda: WindowKV(window=5, order="new_old"), (1, 3, D), 2,
                    _region("cache", 1, "new_old", cf.SlidingWindow(5), 3), 2, (("order 'new_old'", "operand 1 of 2"),)),
    "middle_operand": Case(MiddleCat, (1, 4, D), 2, _region("cache", 1, "old_new", cf.SlidingWindow(6), 4), 2,
                           (("middle operand", "operand 1 of 3"),)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_one_region_is_proposed_and_exact(case: Case):
    seed = list(CASES.values()).index(case)
    torch.manual_seed(seed)
    step = case.make().eval()
    name = case.region.input
    fresh = frames(case.chunk, seed=seed, pos_of=(lambda k: (torch.arange(2) + 2 * k) % 8) if case.pos else None)
    stream = record(step, {name: torch.randn(*case.state)}, {name: 1}, fresh, calls=case.calls)
    want = contract(case.region, stride=case.stride)
    p = proposed(step, stream, want)
    for words in case.says:
        assert any(all(w in s for w in words) for s in p.evidence[name]), (words, p.evidence[name])
    drive_exact(step, want, stream, {name: 1}, fresh)


def test_two_regions_of_different_growth():
    torch.manual_seed(5)
    step = TwoRates().eval()
    fresh = frames(2, seed=5)
    state = {"a": torch.randn(1, 2, D), "b": torch.randn(1, 4, D)}
    stream = record(step, state, {"a": 1, "b": 2}, fresh)
    want = contract(
        cf.Region("a", input="a", output=1, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(6), initial=2),
        cf.Region("b", input="b", output=2, clock="frame", axis=1, order="old_new",
                  retention=cf.SlidingWindow(8), initial=4, growth=4), stride=2)
    p = proposed(step, stream, want)
    assert any("growth=4" in s for s in p.evidence["b"])
    assert "[{'a': 2, 'b': 4}, {'a': 4, 'b': 8}, {'a': 6, 'b': 8}]" in " ".join(p.notes)  # the catalog classes
    drive_exact(step, want, stream, {"a": 1, "b": 2}, fresh)


def test_demo_decoder_regions_are_proposed():
    """The demo decoder (every state pattern of the real one): its contract's regions, named by their inputs,
    less ``live`` (the dead workspace slots are zeros here, so keeping them is exact, only larger)."""
    cfg = DemoConfig()
    torch.manual_seed(0)
    step = StreamingDecoder(cfg).eval()
    enc, est, conv = step.initial_state()
    est[cfg.steps:] = 0  # the slots the solver never writes hold what its workspace holds there
    g = torch.Generator().manual_seed(1)
    fresh = lambda k: {"tokens": torch.randn(1, cfg.chunk, cfg.dim, generator=g),  # noqa: E731
                       "noise": torch.randn(1, cfg.chunk, cfg.dim, generator=g)}
    stream = record(step, {"enc_kv": enc, "est_kv": est, "conv": conv}, {"enc_kv": 1, "est_kv": 2, "conv": 3}, fresh)
    p = cf.propose_contract(step, stream)
    want = tuple(dataclasses.replace(r, name=r.input, live={}) for r in demo_contract(cfg).regions)
    assert p.contract.regions == want, str(p)
    assert "scratch" in " ".join(p.evidence["solver.workspace"])


# --- module buffers ----------------------------------------------------------------------------------------------

BUFFER = dict(name="cache.kv", input="cache.kv", output=None, clock="frame", axis=1, order=None,
              retention=cf.Ring(8), initial=8)


def _buffer_stream():
    torch.manual_seed(6)
    step = BufferKV().eval()
    fresh = frames(2, seed=6, pos_of=lambda k: (torch.arange(2) + 2 * k) % 8)
    stream = record(copy.deepcopy(step), {}, {}, fresh)  # the step itself stays at the stream's start
    return step, fresh, stream


def _buffer_region_constructible() -> bool:
    try:
        cf.Region(**BUFFER)
    except (cf.ContractError, TypeError):
        return False
    return True


def test_module_buffer_cache_is_found_and_proposed():
    assert _buffer_region_constructible()  # Region(output=None): a cache kept in a module buffer
    step, _fresh, stream = _buffer_stream()
    p = proposed(step, stream, contract(cf.Region(**BUFFER), stride=2))
    ev = " ".join(p.evidence["cache.kv"])
    assert "written in place" in ev and "'index_copy_'" in ev and "Ring(8)" in ev and "[0, 1]" in ev
    assert torch.equal(step.cache.kv, torch.zeros(1, 8, D))  # the replay put the buffer back


def test_a_region_this_cadence_fx_refuses_is_printed_commented_out(monkeypatch):
    def region(*args, **fields):  # a cadence_fx from before Region(output=None)
        if fields.get("output", 0) is None:
            raise cf.ContractError("Region 'cache.kv'.output: must be an int, got None")
        return cf.Region(*args, **fields)

    monkeypatch.setattr("cadence_fx.proposal.propose.Region", region)
    step, _fresh, stream = _buffer_stream()
    p = cf.propose_contract(step, stream)
    assert p.contract.regions == () and "not proposed" in " ".join(p.evidence["cache.kv"])
    assert "        # cf.Region('cache.kv', input='cache.kv', output=None" in p.code()
    for text in (p.code(), str(p)):
        ns: dict = {}
        exec(text, ns)
        assert ns["contract"] == p.contract


def test_module_buffer_cache_is_proposed_and_exact():
    step, fresh, stream = _buffer_stream()
    want = contract(cf.Region(**BUFFER), stride=2)
    proposed(step, stream, want)
    drive_exact(step, want, stream, {}, fresh)


def test_module_buffer_proposal_runs_exact_exported_directly():
    """A Ring buffer region has one catalog class: the step exported as it is is the whole catalog."""
    assert _buffer_region_constructible()  # Region(output=None): a cache kept in a module buffer
    step, fresh, stream = _buffer_stream()
    want = contract(cf.Region(**BUFFER), stride=2)
    proposed(step, stream, want)
    drive_exact(step, want, stream, {}, fresh,
                export=lambda m, _c, example: [torch.export.export(m, tuple(example.values()))])


def test_scratch_buffer_is_not_state():
    class Scratch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("ws", torch.zeros(1, 2, D))

        def forward(self, x):
            self.ws.copy_(x * 2)  # written whole before it is read, every call
            return self.ws + 1

    stream = record(Scratch().eval(), {}, {}, frames(2))
    p = cf.propose_contract(Scratch().eval(), stream)
    assert p.contract.regions == () and "scratch" in " ".join(p.evidence["ws"])


# --- wrong on purpose --------------------------------------------------------------------------------------------


def test_state_not_fed_back_gives_no_region_and_says_so():
    torch.manual_seed(7)
    step = WindowKV().eval()
    g = torch.Generator().manual_seed(7)
    stream = [{"x": torch.randn(1, 2, D, generator=g), "cache": torch.randn(1, 6, D, generator=g)} for _ in range(5)]
    p = cf.propose_contract(step, stream)
    assert p.contract.regions == ()
    assert any("not fed back" in s and "no region proposed" in s for s in p.evidence["cache"]), p.evidence
    assert "regions=()" in p.code()


class MiddleWindow(torch.nn.Module):
    """A fixed context that keeps neither end of its concatenation: no retention policy describes it."""

    def forward(self, x, ctx):
        ci = torch.cat([ctx, x], 1)
        return ci.sum(1), ci[:, 1:4]


class Unbounded(torch.nn.Module):
    def forward(self, x, cache):
        kv = torch.cat([cache, x], 1)
        return kv.mean(1), kv


class Decayed(torch.nn.Module):
    """Extents of a sliding window, values that are not the window's (each call scales the history)."""

    def forward(self, x, cache):
        return x.sum(1), torch.cat([cache, x], 1)[:, -6:] * 0.5


@pytest.mark.parametrize("step, match", [
    (MiddleWindow(), r"input 'ctx': a fixed extent 3 on axis 1.*neither the first nor the last"),
    (Unbounded(), r"input 'cache': it grows by 2 at every observed call.*never trimmed"),
    (Decayed(), r"input 'cache'.*no retention policy fits"),
])
def test_state_that_fits_no_policy_raises(step, match):
    first = "ctx" if isinstance(step, MiddleWindow) else "cache"
    stream = record(step.eval(), {first: torch.randn(1, 3 if first == "ctx" else 4, D)}, {first: 1}, frames(2))
    with pytest.raises(cf.ContractError, match=match):
        cf.propose_contract(step, stream)


def test_too_short_a_stream_is_refused():
    step = WindowKV().eval()
    stream = record(step, {"cache": torch.randn(1, 4, D)}, {"cache": 1}, frames(2), calls=2)
    with pytest.raises(ValueError, match="at least 3"):
        cf.propose_contract(step, stream)


def test_positional_calls_are_accepted():
    torch.manual_seed(8)
    step = WindowKV().eval()
    stream = record(step, {"cache": torch.randn(1, 4, D)}, {"cache": 1}, frames(2))
    p = cf.propose_contract(step, [tuple(c.values()) for c in stream])
    assert p.contract == cf.propose_contract(step, stream).contract


@settings(max_examples=8, deadline=None)
@given(chunk=st.integers(1, 3), extra=st.integers(1, 4), initial=st.integers(1, 6))
def test_window_and_chunk_sizes_are_recovered(chunk, extra, initial):
    window = chunk + extra  # longer than a chunk: a history, not the tail of the new input
    initial = min(initial, window - 1)  # below the window: the extent changes, so the axis is seen
    step = WindowKV(window=window).eval()
    stream = record(step, {"cache": torch.randn(1, initial, D)}, {"cache": 1}, frames(chunk), calls=4 + window)
    want = contract(cf.Region("cache", input="cache", output=1, clock="frame", axis=1, order="old_new",
                              retention=cf.SlidingWindow(window), initial=initial), stride=chunk)
    assert cf.propose_contract(step, stream).contract == want


# --- states that reach their cat through other ops, or never concatenated ---------------------------------------


class PadThenCat(torch.nn.Module):
    """Emformer's caches: passed at their filled extent, zero-padded to a fixed size, then concatenated
    (``cat([pad(cache), new])``, the state itself never a cat operand until it is full) and cut back."""

    def __init__(self, window: int = 6):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.window = window

    def forward(self, x, cache):
        n = cache.shape[1]
        full = torch.nn.functional.pad(cache, (0, 0, self.window - n, 0)) if n < self.window else cache
        kv = torch.cat([full, self.proj(x)], 1)[:, -self.window:]
        return attend(x, kv), kv[:, -min(self.window, n + x.shape[1]):]


class RebuiltCache(torch.nn.Module):
    """transformers' ``DynamicCache`` rebuilt from tensors: ``cat([torch.tensor([]), kv])`` (a legacy-empty
    operand torch.cat skips), a cut, then ``cat([kv, new])`` and the window."""

    def __init__(self, window: int = 6):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.window = window

    def forward(self, x, cache):
        kv = torch.cat([torch.tensor([]), cache], -2)[:, -self.window:]
        kv = torch.cat([kv, self.proj(x)], -2)
        return attend(x, kv), kv[:, -self.window:]


class FirstFrameContext(torch.nn.Module):
    """DemucsStreamer's conv state: none before the first frame (an empty input the first call's graph
    never reads), then a conv's context ``cat([ctx[..., 2:], new])`` and an overlap replaced whole."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x, ctx, overlap):
        new = self.proj(x).transpose(1, 2)  # (1, D, 2)
        ctx = new.repeat(1, 1, 3) if ctx.shape[-1] == 0 else torch.cat([ctx[..., 2:], new], -1)
        y = ctx.mean(-1, keepdim=True) + new
        if overlap.shape[-1]:
            y = y + overlap
        return y.transpose(1, 2), ctx, new * 0.5


class GrownInPlace(torch.nn.Module):
    """A history grown with no cat at all: padded by the chunk, the new frames written into the pad."""

    def __init__(self, window: int = 6):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.window = window

    def forward(self, x, cache):
        grown = torch.nn.functional.pad(cache, (0, 0, 0, x.shape[1]))
        grown[:, -x.shape[1]:] = self.proj(x)
        return attend(x, grown), grown[:, -self.window:]


def _says(p: cf.Proposal, name: str, *words: str) -> None:
    assert any(all(w in s for w in words) for s in p.evidence[name]), (words, p.evidence[name])


@pytest.mark.parametrize("make, initial, through", [
    (PadThenCat, 0, ("'cat", "reached through aten.pad", "output is cut from it")),
    (RebuiltCache, 4, ("operand 0 of 2", "aten.cat of it alone, aten.slice")),
    (GrownInPlace, 2, ("order 'old_new' (chosen)", "never concatenates")),
])
def test_state_reaching_its_cat_through_other_ops(make, initial, through):
    torch.manual_seed(9)
    step = make().eval()
    fresh = frames(2, seed=9)
    stream = record(step, {"cache": torch.randn(1, initial, D)}, {"cache": 1}, fresh)
    want = contract(_region("cache", 1, "old_new", cf.SlidingWindow(6), initial), stride=2)
    p = proposed(step, stream, want)
    _says(p, "cache", "order 'old_new'", *through)
    _says(p, "cache", "growth 2 a call", "extents" if make is GrownInPlace else "read off the graph")
    drive_exact(step, want, stream, {"cache": 1}, fresh)


def test_state_empty_before_the_first_call_is_a_ring_from_empty():
    torch.manual_seed(10)
    step = FirstFrameContext().eval()
    fresh = frames(2, seed=10)
    state = {"ctx": torch.zeros(1, D, 0), "overlap": torch.zeros(1, D, 0)}
    stream = record(step, state, {"ctx": 1, "overlap": 2}, fresh)
    want = contract(cf.Region("ctx", input="ctx", output=1, clock="frame", axis=2, order="old_new",
                              retention=cf.Ring(6), initial=0),
                    cf.Region("overlap", input="overlap", output=2, clock="frame", axis=2, order=None,
                              retention=cf.Ring(2), initial=0), stride=2)
    p = proposed(step, stream, want)
    _says(p, "ctx", "empty", "exported on calls[1]")
    _says(p, "ctx", "Ring(capacity=6)", "empty at the first call", "last 6 positions")
    _says(p, "overlap", "Ring(2), order None", "empty at the first call")
    drive_exact(step, want, stream, {"ctx": 1, "overlap": 2}, fresh)


class ObjectHeldCache(torch.nn.Module):
    """transformers' ``TorchExportableModuleWithStaticCache``: ``forward(x=None, embeds=None, pos=None)``
    called by keyword, its cache a module buffer the step reaches through a plain object holding it
    (``StaticCache.layers[i].keys``), which a non-strict export lifts as a constant."""

    def __init__(self, capacity: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.store = type("Layer", (), {})()
        self.store.kv = torch.zeros(1, capacity, D)
        self.register_buffer("kv", self.store.kv, persistent=False)

    def forward(self, x=None, embeds=None, pos=None):
        self.store.kv.index_copy_(1, pos, self.proj(x))
        return attend(x, self.store.kv)


def test_keyword_calls_and_a_buffer_held_through_an_object():
    torch.manual_seed(11)
    step = ObjectHeldCache().eval()
    fresh = lambda k: {"x": torch.randn(1, 2, D), "pos": (torch.arange(2) + 2 * k) % 8}  # noqa: E731
    stream = []
    with torch.no_grad():
        driver = copy.deepcopy(step)  # the step itself stays at the stream's start
        for k in range(6):
            stream.append(fresh(k))
            driver(**{n: v.clone() for n, v in stream[-1].items()})
    want = contract(cf.Region(**dict(BUFFER, name="kv", input="kv")), stride=2)
    p = proposed(step, stream, want)
    assert "by keyword" in p.notes[0] and any("strict=True" in n for n in p.notes), p.notes
    assert step.kv.is_leaf and not step.kv.requires_grad and step.store.kv is step.kv
    assert torch.equal(step.kv, torch.zeros(1, 8, D))
    drive_exact(step, want, stream, {}, fresh,
                export=lambda m, _c, example: [torch.export.export(m, (), dict(example), strict=True)])
