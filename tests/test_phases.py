"""Phases of a step that share an input signature (a first call, a position-dependent path), dispatched
by a declared rule on a scalar input (``Contract.phase``), bit-exact; collisions refused clearly."""

from __future__ import annotations

import pytest
import torch

import cadence_fx as cf

W, C = 4, 3


class Step(torch.nn.Module):
    """The first call (pos 0) normalises the prompt; later calls do not: one signature, two code paths."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.proj = torch.nn.Linear(C, C)

    def forward(self, x, cache, pos):
        h = self.proj(x)
        if self.first:
            h = h / h.norm(dim=-1, keepdim=True)
        full = torch.cat([cache, h], 1)
        return (full.sum(1) + pos, full[:, -W:])


def _contract(phase=cf.Phase("pos", (1,))):
    return cf.Contract(clocks=(cf.Clock("f", 1),), regions=(
        cf.Region("cache", input="cache", output=1, clock="f", axis=1, order="old_new", retention=cf.Ring(W),
                  initial=W),), phase=phase, wrap=(cf.WHOLE_STEP,))


def _export(first: bool, pos: int):
    torch.manual_seed(0)
    return torch.export.export(Step(first).eval(), (torch.randn(1, 1, C), torch.zeros(1, W, C), torch.tensor(pos)))


def test_phases_dispatch_by_value_bit_exact():
    eps = [_export(True, 0), _export(False, 5)]
    prog = cf.optimize(eps, _contract())
    first, rest = eps[0].module(), eps[1].module()
    g = torch.Generator().manual_seed(1)
    s_ref = s_opt = torch.zeros(1, W, C)
    s = prog.session()
    s_ses = torch.zeros(1, W, C)
    for k in range(12):
        x, pos = torch.randn(1, 1, C, generator=g), torch.tensor(k)
        ref = (first if k == 0 else rest)(x, s_ref, pos)
        got = prog(x, s_opt, pos)
        ses = s(x, s_ses, pos)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ref, got, ses)), k
        s_ref, s_opt, s_ses = ref[1], got[1], ses[1]


def test_same_signature_without_phase_is_refused_with_a_hint():
    eps = [_export(True, 0), _export(False, 5)]
    with pytest.raises(cf.ContractError, match="declare Contract.phase"):
        cf.optimize(eps, _contract(phase=None))


def test_two_programs_of_one_phase_collide():
    eps = [_export(True, 2), _export(False, 5)]
    with pytest.raises(cf.ContractError, match="same phase"):
        cf.optimize(eps, _contract())


def test_phase_input_must_be_an_integer_scalar():
    eps = [_export(True, 0), _export(False, 5)]
    prog = cf.optimize(eps, _contract())
    with pytest.raises(cf.CatalogMiss, match="phase input"):
        prog(torch.randn(1, 1, C), torch.zeros(1, W, C), torch.tensor([1.5]))


@pytest.mark.parametrize("bad", [(), (2, 1), ("a",)])
def test_bad_phase_declarations(bad):
    with pytest.raises(cf.ContractError, match="Phase.at"):
        cf.Phase("pos", bad)


def test_phase_names_an_input():
    with pytest.raises(cf.ContractError, match="names no input"):
        cf.optimize([_export(True, 0)], _contract(phase=cf.Phase("nope", (1,))))


def test_phases_survive_save_and_load(tmp_path):
    eps = [_export(True, 0), _export(False, 5)]
    prog = cf.optimize(eps, _contract())
    cf.save(prog, tmp_path / "p.cfx")
    back = cf.load(tmp_path / "p.cfx")
    assert back.contract.phase == prog.contract.phase
    x = torch.randn(1, 1, C)
    for k in (0, 3):
        a = prog(x, torch.zeros(1, W, C), torch.tensor(k))
        b = back(x, torch.zeros(1, W, C), torch.tensor(k))
        assert all(torch.equal(u.clone(), v.clone()) for u, v in zip(a, b))
