"""A region's whole new value computed by one elementwise op goes straight into the region's buffer.

moshi's ``LMGen`` replaces its frame counter every call (``offsets = torch.where(mask, offsets + 1,
offsets)``); the rewrite computes the ``where`` into the buffer (its ``out=`` form) where the stock
graph computes a new tensor, instead of copying the new tensor in afterwards. It must not fire when
the old value is read after the op: then the in-place result would be read in its place.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.contract import Ring
from cadence_fx.plan import state_traffic

CLOCK = cf.Clock("frame", 1)


class CounterStep(torch.nn.Module):
    """``(x, count) -> (y, count')``: the counter advances where ``x`` is positive; ``y`` reads the new
    counter (``late_old``: and also the old one, after the update)."""

    def __init__(self, late_old: bool = False) -> None:
        super().__init__()
        self.late_old = late_old

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = torch.where(x[:, :1] > 0, count + 1, count)
        y = x * new
        if self.late_old:
            y = y + count  # the old value, read after the update
        return y, new


def _optimize(step: torch.nn.Module):
    x, count = torch.randn(2, 4), torch.zeros(2, 1)
    ep = torch.export.export(step, (x, count))
    contract = cf.Contract(clocks=(CLOCK,), regions=(
        cf.Region("count", input="count", output=1, clock="frame", axis=1, order=None, retention=Ring(1), initial=1),),
        wrap=(cf.WHOLE_STEP,))
    return ep, cf.optimize(ep, contract, replay="off")


def _stream(fn, calls: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    count, outs = torch.zeros(2, 1), []
    for _ in range(calls):
        y, count = fn(torch.randn(2, 4, generator=g), count)
        outs += [y.clone(), count.clone()]
    return outs


def test_a_counter_replaced_every_call_is_computed_into_its_buffer():
    ep, prog = _optimize(CounterStep())
    assert prog.stats["passes"]["computed_into_region"] == 1
    assert prog.stats["passes"].get("retention_in_place", 0) == 0  # no copy into the buffer
    traffic = state_traffic(prog)[0]["regions"]["count"]
    assert traffic["optimized"] <= traffic["stock"]
    ref = _stream(ep.module())
    got = _stream(prog)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_not_when_the_old_value_is_read_afterwards():
    ep, prog = _optimize(CounterStep(late_old=True))
    assert prog.stats["passes"].get("computed_into_region", 0) == 0
    assert prog.stats["passes"]["retention_in_place"] == 1  # the stock value, copied in at the end
    assert all(torch.equal(a, b) for a, b in zip(_stream(prog), _stream(ep.module())))


class ReturnsCounterTwice(torch.nn.Module):
    """The new counter is the state output and also a plain output the caller may keep."""

    def __init__(self, as_view: bool = False) -> None:
        super().__init__()
        self.as_view = as_view

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        new = torch.where(x[:, :1] > 0, count + 1, count)
        return x * new, new, (new.view(1, 2) if self.as_view else new)


@pytest.mark.parametrize("as_view", [False, True], ids=["itself", "a-view"])
def test_not_when_the_new_value_is_also_a_plain_output(as_view):
    """A plain output must not become a view of the region buffer (the next call would overwrite what the
    caller kept): the value stays a fresh tensor, copied into the buffer."""
    x, count = torch.randn(2, 4), torch.zeros(2, 1)
    ep = torch.export.export(ReturnsCounterTwice(as_view), (x, count))
    contract = cf.Contract(clocks=(CLOCK,), regions=(
        cf.Region("count", input="count", output=1, clock="frame", axis=1, order=None, retention=Ring(1), initial=1),),
        wrap=(cf.WHOLE_STEP,))
    prog = cf.optimize(ep, contract, replay="off")
    assert prog.stats["passes"].get("computed_into_region", 0) == 0
    y, state, kept = prog(x, count)
    kept_before = kept.clone()
    prog(torch.ones(2, 4), state)
    assert torch.equal(kept, kept_before)


class Generated(torch.nn.Module):
    """A state update made by one elementwise op (``op``), read afterwards as chosen: the new value by
    the output (``reads_new``), the old one after the update (``reads_old_late``), the new one returned
    a second time (``returns_new``)."""

    OPS = {
        "where": lambda x, c: torch.where(x[:, :1] > 0, c + 1, c),
        "add": lambda x, c: torch.add(c, x[:, :1]),
        "mul": lambda x, c: torch.mul(c, 0.5),
        "clamp": lambda x, c: torch.clamp(c + x[:, :1], -2.0, 2.0),
    }

    def __init__(self, op: str, reads_new: bool, reads_old_late: bool, returns_new: bool) -> None:
        super().__init__()
        self.op, self.reads_new, self.reads_old_late, self.returns_new = op, reads_new, reads_old_late, returns_new

    def forward(self, x: torch.Tensor, count: torch.Tensor):
        new = self.OPS[self.op](x, count)
        y = x * new if self.reads_new else x * 2
        if self.reads_old_late:
            y = y + count
        return (y, new, new) if self.returns_new else (y, new)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(sorted(Generated.OPS)), reads_new=st.booleans(), reads_old_late=st.booleans(),
       returns_new=st.booleans(), seed=st.integers(0, 2**16))
def test_generated_updates_are_exact_and_computed_in_only_when_safe(op, reads_new, reads_old_late, returns_new,
                                                                    seed):
    """Every generated step equals the exported program call after call (every output, the state
    included), and the update is computed into the buffer exactly when nothing reads the old value
    after it and it is not also a plain output."""
    step = Generated(op, reads_new, reads_old_late, returns_new)
    x, count = torch.randn(2, 4), torch.zeros(2, 1)
    ep = torch.export.export(step, (x, count))
    contract = cf.Contract(clocks=(CLOCK,), regions=(
        cf.Region("count", input="count", output=1, clock="frame", axis=1, order=None, retention=Ring(1), initial=1),),
        wrap=(cf.WHOLE_STEP,))
    prog = cf.optimize(ep, contract, replay="off")
    expect = not reads_old_late and not returns_new
    assert (prog.stats["passes"].get("computed_into_region", 0) == 1) == expect
    ref_mod = ep.module()
    g = torch.Generator().manual_seed(seed)
    c_ref = c_opt = torch.zeros(2, 1)
    kept = []
    for _ in range(5):
        xk = torch.randn(2, 4, generator=g)
        ref, opt = ref_mod(xk, c_ref), prog(xk, c_opt)
        kept.append((opt, [t.clone() for t in ref]))
        assert all(torch.equal(a, b) for a, b in zip(opt, ref))
        c_ref, c_opt = ref[1], opt[1]
    # what the caller kept of earlier calls is unchanged, except the state each call handed on
    for opt, ref in kept[:-1]:
        assert torch.equal(opt[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(opt[2:], ref[2:]))
