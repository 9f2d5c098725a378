"""A region's whole new value computed by one elementwise op goes straight into the region's buffer.

moshi's ``LMGen`` replaces its frame counter every call (``offsets = torch.where(mask, offsets + 1,
offsets)``); the rewrite computes the ``where`` into the buffer (its ``out=`` form) where the stock
graph computes a new tensor, instead of copying the new tensor in afterwards. It must not fire when
the old value is read after the op: then the in-place result would be read in its place.
"""

from __future__ import annotations

import pytest
import torch

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
