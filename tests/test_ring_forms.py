"""Functional ring writes (``index_copy``, ``scatter``, ``index_put``, a slice assignment after
functionalization, a masked ``where``), in both export forms, are written in place: bit-exact, and
fewer state bytes per call than the stock program (``where``: computed into the buffer, no move)."""

from __future__ import annotations

import copy

import pytest
import torch

import cadence_fx as cf

C, N, D = 8, 2, 4


class Ring(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.p = torch.nn.Linear(D, D)

    def forward(self, x, cache, pos):
        v = self.p(x)
        if self.how == "index_copy":
            new = cache.index_copy(1, pos, v)
        elif self.how == "scatter":
            new = cache.scatter(1, pos.view(1, N, 1).expand(1, N, D), v)
        elif self.how == "where":  # one position written through a mask
            new = torch.where((torch.arange(C) == pos[0]).view(1, C, 1), v[:, :1], cache)
        elif self.how == "slice":
            new = cache.clone()
            new[:, pos] = v
        else:
            new = cache.index_put((torch.zeros(N, dtype=torch.long), pos), v[0])
        return (new * 2).sum(1), new


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("how", ["index_copy", "scatter", "where", "slice", "index_put"])
def test_functional_ring_written_in_place(how, decompose):
    contract = cf.Contract(clocks=(cf.Clock("f", N),), regions=(
        cf.Region("ring", input="cache", output=1, clock="f", axis=1, order=None, retention=cf.Ring(C), initial=C),))
    torch.manual_seed(0)
    ep = torch.export.export(Ring(how).eval(), (torch.randn(1, N, D), torch.zeros(1, C, D), torch.arange(N)))
    ep = ep.run_decompositions() if decompose else ep
    prog = cf.optimize(ep, contract, replay="off")
    ref = copy.deepcopy(ep).module()
    a = b = torch.zeros(1, C, D)
    g = torch.Generator().manual_seed(1)
    for k in range(12):
        x, pos = torch.randn(1, N, D, generator=g), (torch.arange(N) + k * N) % C
        with torch.no_grad():
            r = ref(x, a, pos)
        o = prog(x, b, pos)
        assert all(torch.equal(u, v) for u, v in zip(r, o)), k
        assert o[1].data_ptr() == prog.region_pointer("ring")
        a, b = r[1], o[1]
    row = cf.state_traffic(prog)[0]
    counts = row["regions"]["ring"]
    assert not row["left_stock"]
    if how == "where":
        assert prog.stats["passes"]["computed_into_region"] == 1 and counts["optimized"] == counts["stock"] == 0
    else:
        assert prog.stats["passes"]["ring_in_place"] >= 1
        assert counts["optimized"] == N * D * 4 < counts["stock"]  # the written positions only
