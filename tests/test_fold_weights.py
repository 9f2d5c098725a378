"""Constant cones on CPU: a fixed solver schedule's timestep embedding and adaLN modulation (host-built:
they start at ``linspace``) and weight-derived values (weight norm, Snake's 1/alpha, under
``fold_weights``) are computed once at optimize time, bit-exact, shared by a catalog, and guarded."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.utils.parametrizations import weight_norm

import cadence_fx as cf
from cadence_fx.annotations import CONST_PREFIX

STEPS, DIM = 3, 8


class Snake(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.rand(1, channels, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class Solver(torch.nn.Module):
    """An Euler loop whose schedule is built inside the step, like Token2Wav's CFM: every step's
    timestep embedding and modulation depend on the weights alone."""

    def __init__(self, steps: int = STEPS, dim: int = DIM, norm: bool = True, kernel: int = 3) -> None:
        super().__init__()
        self.steps, self.dim = steps, dim
        self.t_mlp = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.SiLU(), torch.nn.Linear(dim, dim))
        self.ada = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(dim, 2 * dim))
        conv = torch.nn.Conv1d(dim, dim, kernel, padding=kernel // 2)
        self.body = weight_norm(conv) if norm else conv
        self.snake = Snake(dim)

    def embed(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(100.0) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
        args = t[:, None] * freqs[None]
        return self.t_mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t_span = 1 - torch.cos(torch.linspace(0, 1, self.steps + 1, device=x.device) * 0.5 * torch.pi)
        t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
        for step in range(1, self.steps + 1):
            shift, scale = self.ada(self.embed(t)).unsqueeze(-1).chunk(2, dim=1)
            v = self.snake(self.body(x * (1 + scale) + shift))
            x = x + dt * v
            t = t + dt
            if step < self.steps:
                dt = t_span[step + 1] - t
        return x


def _export(model: torch.nn.Module, frames: int):
    return torch.export.export(model, (torch.randn(1, DIM, frames),))


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _contract(fold: bool = True) -> cf.Contract:
    return cf.Contract(clocks=(cf.Clock("frame", 5),), fold_weights=fold)


def test_weight_derived_cones_are_computed_once_and_bit_exact():
    torch.manual_seed(0)
    model = Solver().eval()
    ep = _export(model, 5)
    prog = cf.optimize(ep, _contract(), replay="off")
    # ada(embed(t)) at each step (3 linears + silu each) and the weight norm are folded;
    # only the convolutions on x remain
    ops = _ops(prog.graph_modules()[0])
    assert sum("linear" in o for o in ops) == 0 and sum("_weight_norm" in o for o in ops) == 0, ops
    assert sum("conv1d" in o for o in ops) == STEPS and sum("reciprocal" in o for o in ops) == 0, ops
    assert prog.stats["passes"]["fold_weights"] >= STEPS + 2
    ref = ep.module()
    for k in range(4):
        x = torch.randn(1, DIM, 5, generator=torch.Generator().manual_seed(k))
        with torch.no_grad():
            assert torch.equal(prog(x), ref(x))


def test_without_folding_the_weight_cones_stay_in_the_graph_and_agree():
    torch.manual_seed(1)
    ep = _export(Solver().eval(), 5)
    folded = cf.optimize(ep, _contract(True), replay="off")
    live = cf.optimize(ep, _contract(False), replay="off")
    assert live.stats["passes"].get("fold_weights", 0) == 0
    ops = _ops(live.graph_modules()[0])
    # the schedule's cone is host-built (it starts at linspace), so it is hoisted either way;
    # the cones that start at weights alone stay
    assert sum("linear" in o for o in ops) == 0
    assert sum("_weight_norm" in o for o in ops) == STEPS and sum("reciprocal" in o for o in ops) == STEPS, ops
    x = torch.randn(1, DIM, 5)
    assert torch.equal(folded(x), live(x))


def test_an_in_place_weight_change_after_folding_is_an_error_not_a_stale_value():
    torch.manual_seed(2)
    ep = _export(Solver().eval(), 5)
    prog = cf.optimize(ep, _contract(), replay="off")
    x = torch.randn(1, DIM, 5)
    prog(x)
    for name in ("snake.alpha", "ada.1.weight"):  # a folded weight; a weight in the schedule's cone
        weight = ep.state_dict[name]
        with torch.no_grad():
            weight.mul_(2.0)
        with pytest.raises(cf.WeightsChanged, match=name.replace(".", r"\.")):
            prog(x)
        prog = cf.optimize(ep, _contract(), replay="off")  # optimizing again reads the new weights
        with torch.no_grad():
            assert torch.equal(prog(x), ep.module()(x))


def test_a_catalog_keeps_one_copy_of_each_folded_value():
    torch.manual_seed(3)
    model = Solver().eval()
    eps = [_export(model, 5), _export(model, 7)]
    prog = cf.optimize(eps, _contract(), replay="off")
    ptrs = []
    for gm in prog.graph_modules():
        ptrs.append({getattr(gm, n.target).data_ptr() for n in gm.graph.nodes
                     if n.op == "get_attr" and n.target.startswith(CONST_PREFIX)})
    assert ptrs[0] and ptrs[0] == ptrs[1]
    for ep, frames in zip(eps, (5, 7)):
        x = torch.randn(1, DIM, frames)
        with torch.no_grad():
            assert torch.equal(prog(x), ep.module()(x))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(1, 4), dim=st.sampled_from([2, 4, 8, 16]), norm=st.booleans(),
       kernel=st.sampled_from([1, 3, 5]), frames=st.lists(st.integers(1, 9), min_size=1, max_size=3, unique=True),
       fold=st.booleans(), seed=st.integers(0, 2**16))
def test_folding_is_bit_identical_on_generated_solvers(steps, dim, norm, kernel, frames, fold, seed):
    """Generated solvers (steps, width, weight norm or not, kernel, a catalog of chunk sizes): the
    optimized catalog, folded or not, equals the exported programs bit for bit on random inputs."""
    torch.manual_seed(seed)
    model = Solver(steps, dim, norm, kernel).eval()
    eps = [torch.export.export(model, (torch.randn(1, dim, f),)) for f in frames]
    prog = cf.optimize(eps, cf.Contract(clocks=(cf.Clock("frame", frames[0]),), fold_weights=fold), replay="off")
    assert (prog.stats["passes"].get("fold_weights", 0) > 0) == fold  # Snake's 1/alpha at least
    g = torch.Generator().manual_seed(seed)
    for ep, f in zip(eps, frames):
        for _ in range(2):
            x = torch.randn(1, dim, f, generator=g)
            with torch.no_grad():
                assert torch.equal(prog(x), ep.module()(x))


def test_a_host_tensor_moved_to_the_device_every_call_is_hoisted_with_or_without_folding():
    """``table.to(x.device)`` of a host buffer is a view by its schema but a copy on every call;
    hoisting it is about host-built constants, so folding weights must not drop it."""
    class Lookup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(6.0).double())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.table.to(x.dtype)[: x.shape[-1]]

    ep = torch.export.export(Lookup(), (torch.randn(2, 4),))
    assert any("to" in str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    for fold in (False, True):
        prog = cf.optimize(ep, _contract(fold), replay="off")
        assert not any(".to" in str(n.target) or "_to_copy" in str(n.target)
                       for n in prog.graph_modules()[0].graph.nodes if n.op == "call_function"), fold
        x = torch.randn(2, 4)
        assert torch.equal(prog(x), ep.module()(x))
