"""Ring-buffer caches written in place (Moshi-style): no copy of the ring per call, bit-exact."""

from __future__ import annotations

import pytest
import torch

import cadence_fx as cf
from cadence_fx.testing.fake_backend import FakeBackend

C, N, D = 8, 2, 4


class RingKV(torch.nn.Module):
    """Writes ``n`` new positions at ``pos % C`` in place and attends over the whole ring."""

    def __init__(self, axis: int, how: str):
        super().__init__()
        self.axis, self.how = axis, how
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x, cache, pos):
        new = self.proj(x).movedim(2, self.axis)  # x: (1, 2, n, D); the clock axis moved where the cache has it
        if self.how == "index_copy":
            cache.index_copy_(self.axis, pos, new)
        elif self.how == "scatter":
            shape = [1] * cache.dim()
            shape[self.axis] = pos.numel()
            cache.scatter_(self.axis, pos.view(shape).expand_as(new), new)
        else:  # a slice assignment at a fixed offset (pos[0] is the write position, static per class)
            cache.narrow(self.axis, 0, N).copy_(new)
        kv = cache.movedim(self.axis, 2)
        att = torch.softmax(x @ kv.transpose(2, 3), -1) @ kv
        return att, cache


def _shape(axis: int) -> tuple[int, ...]:
    shape = [1, 2, D]
    shape.insert(axis, C)
    return tuple(shape)


@pytest.mark.parametrize("how", ["index_copy", "scatter", "slice"])
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_ring_written_in_place_costs_no_copy_and_is_exact(axis, how):
    torch.manual_seed(axis)
    step = RingKV(axis, how).eval()
    contract = cf.Contract(clocks=(cf.Clock("frame", N),), wrap=("proj",), regions=(
        cf.Region("ring", input="cache", output=1, clock="frame", axis=axis, order=None,
                  retention=cf.Ring(C), initial=C),))
    x0, cache0, pos0 = torch.randn(1, 2, N, D), torch.randn(*_shape(axis)), torch.arange(N)
    eps = [torch.export.export(step, (x0, cache0.clone(), pos0))]
    for verify in (False, True):
        prog = cf.optimize(eps, contract, replay=FakeBackend(), verify=verify)
        assert prog.stats["passes"].get("retention_in_place", 0) == 0  # no copy of the ring into its buffer
        ref = cf.reference(eps)
        r_cache, o_cache = cache0.clone(), cache0.clone()
        g = torch.Generator().manual_seed(5)
        for k in range(2 * C):
            x = torch.randn(1, 2, N, D, generator=g)
            pos = (torch.arange(N) + k * N) % C
            r = ref(x, r_cache, pos)
            o = prog(x, o_cache, pos)
            assert torch.equal(r[0], o[0]) and torch.equal(r[1], o[1]), (k, verify)
            r_cache, o_cache = r[1].clone(), o[1]
            assert o_cache.data_ptr() == prog.region_pointer("ring")
        assert prog.stats["state_in_place"] == 2 * C - 1


def test_ring_declared_with_an_order_but_written_in_place_is_refused():
    step = RingKV(2, "index_copy").eval()
    contract = cf.Contract(clocks=(cf.Clock("frame", N),), regions=(
        cf.Region("ring", input="cache", output=1, clock="frame", axis=2, order="old_new",
                  retention=cf.Ring(C), initial=C),))
    eps = [torch.export.export(step, (torch.randn(1, 2, N, D), torch.randn(1, 2, C, D), torch.arange(N)))]
    with pytest.raises(cf.ContractError, match=r"never concatenates input 'cache' along axis 2, but order='old_new'"):
        cf.optimize(eps, contract, replay="off")
