"""Autocast blocks inside a step (the float16 switch of a speech decoder) through the pipeline.

torch.export records ``with torch.autocast(...)`` as a higher-order op over a subgraph; the
``inline_autocast`` pass lowers it to the casts autocast makes. The optimized program must give the
bytes of the unmodified program, with the cache update inside the block rewritten like any other.
"""

from __future__ import annotations

import pytest
import torch

import cadence_fx as cf

WINDOW = 6
D = 96
B = 3


class HalfAttention(torch.nn.Module):
    """A half-precision layer under autocast with a growing KV cache: ``(x, cache) -> (y, cache')``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(D, D).half()
        self.out = torch.nn.Linear(D, D)  # float32, outside the block

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(x.device.type, dtype=torch.float16):
            k = self.proj(x)  # (B, T, D) @ (D, D): matmul picks its kernels by the weight's requires_grad
            cache = torch.cat([cache, k], dim=1)
            att = torch.softmax(k @ cache.transpose(1, 2), dim=-1) @ cache
        return self.out(att.float()), cache[:, -WINDOW:]


def _contract(cache_frames: int) -> cf.Contract:
    return cf.Contract(clocks=(cf.Clock("frame", 2),), regions=(cf.Region(
        "kv", input="cache", output=1, clock="frame", axis=1, order="old_new", retention=cf.SlidingWindow(cache_frames),
        initial=2),))


@pytest.mark.parametrize("state", [True, False], ids=["state-rule", "no-state-rule"])
def test_an_autocast_block_is_lowered_and_bit_exact(state):
    model = HalfAttention().eval()
    contract = _contract(WINDOW)
    example = {"x": torch.randn(B, 2, D), "cache": torch.zeros(B, 2, D, dtype=torch.float16)}
    eps = cf.export_catalog(model, contract, example)
    assert any("autocast" in str(n.target) for ep in eps for n in ep.graph.nodes)
    prog = cf.optimize(eps, contract, replay="off", state=state)
    assert prog.stats["passes"]["inline_autocast"] == len(eps)
    ref = cf.reference(eps)
    g = torch.Generator().manual_seed(1)
    cache_r = cache_o = torch.randn(B, 2, D, generator=g).half()
    for _ in range(6):  # grows to the window, then slides
        x = torch.randn(B, 2, D, generator=g)
        with torch.no_grad():
            y_r, cache_r = ref(x, cache_r)
            y_o, cache_o = prog(x, cache_o)
        assert torch.equal(y_r, y_o) and torch.equal(cache_r, cache_o)


def test_sessions_on_several_lanes_through_a_lowered_autocast_block_are_exact():
    """Each lane rewrites the programs again (the lowered block is retraced once and reused): two
    sessions on two lanes each equal the unmodified programs, call after call."""
    model = HalfAttention().eval()
    contract = _contract(WINDOW)
    example = {"x": torch.randn(B, 2, D), "cache": torch.zeros(B, 2, D, dtype=torch.float16)}
    eps = cf.export_catalog(model, contract, example)
    prog = cf.optimize(eps, contract, replay="off", lanes=2)
    ref = cf.reference(eps)
    a, b = prog.session("a"), prog.session("b")
    g = torch.Generator().manual_seed(3)
    cache_r = cache_a = cache_b = torch.randn(B, 2, D, generator=g).half()
    for _ in range(5):
        x = torch.randn(B, 2, D, generator=g)
        with torch.no_grad():
            y_r, cache_r = ref(x, cache_r)
            y_a, cache_a = a(x, cache_a)
            y_b, cache_b = b(x, cache_b)
        for y, c in ((y_a, cache_a), (y_b, cache_b)):
            assert torch.equal(y, y_r) and torch.equal(c, cache_r)
