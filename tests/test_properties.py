"""Hypothesis: generated streaming models and contracts; the rewritten program equals the original."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog
from tests.helpers import live_view, run_streams, sha256

REGION_OUT = {1: 1, 2: 2, 3: 3}


@st.composite
def configs(draw):
    chunk = draw(st.integers(1, 5))
    head = draw(st.integers(0, 8))
    tail = draw(st.integers(1, 6))
    prompt = draw(st.integers(1, 12))
    steps = draw(st.integers(1, 3))
    cfg = DemoConfig(
        dim=8, chunk=chunk, prompt=prompt, head=head, tail=tail, steps=steps,
        slots=steps + draw(st.integers(0, 2)), capacity=max(prompt, head + tail) + chunk + draw(st.integers(0, 8)),
        kernel=draw(st.integers(2, 4)),
        est_order=draw(st.sampled_from(["old_new", "new_old"])),
        enc_order=draw(st.sampled_from(["old_new", "new_old"])),
    )
    wrap = draw(st.sampled_from([(), ("encoder", "solver"), ("solver.estimator",), ("encoder",)]))
    return cfg, wrap, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_rewritten_program_is_bit_identical(case):
    cfg, wrap, verify, seed = case
    torch.manual_seed(seed)
    model = StreamingDecoder(cfg).eval()
    contract = demo_contract(cfg, wrap=wrap)
    eps = export_catalog(model, contract)
    prog = cf.optimize(eps, contract, verify=verify)
    classes = cf.call_classes(contract)
    calls = len(classes) + 3  # past the last new class, through at least two retention events

    def make(k, state):
        g = torch.Generator().manual_seed(seed + k)
        return (torch.randn(1, cfg.chunk, cfg.dim, generator=g), state[0], state[1], state[2],
                torch.randn(1, cfg.chunk, cfg.dim, generator=g))

    refs, opts, ptrs = run_streams(eps, prog, make, list(model.initial_state()), REGION_OUT, calls)
    live = {2: {0: cfg.steps}}  # the estimator cache is compared on its live step slots
    for k, (r, o) in enumerate(zip(refs, opts)):
        for j, (a, b) in enumerate(zip(live_view(r, live), o)):
            assert a.shape == b.shape and torch.equal(a, b), f"call {k} output {j}"
    assert sha256([t for r in refs for t in live_view(r, live)]) == sha256([t for o in opts for t in o])
    assert all(p == ptrs[0] for p in ptrs)
    # the stream went through at least two retention events (input extent + chunk > head + tail)
    extents = [o[1].shape[1] for o in opts]
    inputs = [cfg.prompt] + extents[:-1]
    assert sum(t + cfg.chunk > cfg.head + cfg.tail for t in inputs) >= 2
