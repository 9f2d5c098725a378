"""The demo decoder on the GPU: replayed (both clocks) and bit-exact with the unmodified program."""

from __future__ import annotations

import copy

import pytest
import torch

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog
from cadence_fx.determinism import pin_envelope
from tests.helpers import live_view, run_streams, sha256

pytestmark = pytest.mark.cuda
REGION_OUT = {1: 1, 2: 2, 3: 3}


@pytest.mark.parametrize("wrap", [("encoder", "solver"), ("encoder", "solver.estimator")], ids=["chunk", "step"])
@pytest.mark.parametrize("state", [True, False], ids=["S", "noS"])
def test_replayed_stream_is_bit_exact(wrap, state):
    pin_envelope()
    cfg = DemoConfig(dim=64, chunk=8, prompt=24, head=24, tail=16, steps=4, slots=6, capacity=128)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().cuda()
    contract = demo_contract(cfg, wrap=wrap)
    eps = export_catalog(model, contract, device="cuda")
    # the reference gets its own module buffers: without the state rule the returned state is a
    # view of the program's workspace, which a shared reference would overwrite between calls
    ref_eps = export_catalog(copy.deepcopy(model), contract, device="cuda")
    prog = cf.optimize(eps, contract, state=state, verify=state)
    state0 = list(model.initial_state(device="cuda"))
    z = torch.zeros(1, cfg.chunk, cfg.dim, device="cuda")
    report = prog.warmup(z, *state0, z)

    def make(k, st):
        g = torch.Generator().manual_seed(100 + k)
        return (torch.randn(1, cfg.chunk, cfg.dim, generator=g).cuda(), st[0], st[1], st[2],
                torch.randn(1, cfg.chunk, cfg.dim, generator=g).cuda())

    refs, opts, ptrs = run_streams(eps, prog, make, state0, REGION_OUT, 20, restore_at=12,
                                   ref_eps=ref_eps)
    live = {2: {0: cfg.steps}} if state else {}  # the estimator cache on its live step slots
    for k, (r, o) in enumerate(zip(refs, opts)):
        assert all(torch.equal(a, b) for a, b in zip(live_view(r, live), o)), f"call {k}"
    assert sha256([t for r in refs for t in live_view(r, live)]) == sha256([t for o in opts for t in o])
    c = prog.counters()
    print(f"[demo-cuda] wrap={wrap} state={state}: 20 calls bit-exact, warm-up {report['seconds']:.2f} s, "
          f"counters {c}")
    assert c["replays"] > 0 and c["captures"] > 0
    if state:
        assert all(p == ptrs[1] for p in ptrs[1:])
        assert c["eager"] == 0, c  # every wrapped call of every class replays


def test_host_state_into_the_envelope_stages_in_small_slices():
    """A state in the envelope layout is a strided view of its buffer: copied in from the host (a
    prompt's state, a restored snapshot) or out (``cf.state_to``), PyTorch would stage it through a
    contiguous device temporary as large as the state; the runtime copies in slices instead."""
    from cadence_fx.runtime.state import copy_into

    cfg = DemoConfig(dim=512, chunk=8, prompt=4096, head=4096, tail=64, steps=4, slots=6, capacity=4096 + 128)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().cuda()
    contract = demo_contract(cfg, wrap=("encoder", "solver"))
    eps = export_catalog(model, contract, device="cuda")
    prog = cf.optimize(eps, contract, replay="off")
    site = prog.region_sites()["estimator_kv"]
    assert site.envelope is not None
    host = model.initial_state()[1][: site.live_shape[0]].contiguous()  # the solver history, on the host
    nbytes = host.numel() * host.element_size()
    assert nbytes > 32 << 20, nbytes
    buf = prog.region_buffers["estimator_kv"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    view = copy_into(buf, "estimator_kv", host, site)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= (32 << 20) + (1 << 20)
    assert not view.is_contiguous() and torch.equal(view.cpu(), host)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    back = cf.state_to(view, "cpu")
    assert torch.cuda.max_memory_allocated() - base <= (32 << 20) + (1 << 20)
    assert back.is_contiguous() and torch.equal(back, host)


def test_warmup_without_the_state_rule_makes_missing_inputs_on_the_device():
    """Warm-up given only the per-call inputs: without the state rule there are no region buffers to
    take a device from, so the missing state inputs are made where the exported program expects them
    (before, on the host: the captures then saw host tensors and a later call fell back to eager
    with host and device tensors mixed, as the Moshi R cell did at released size)."""
    pin_envelope()
    cfg = DemoConfig(dim=64, chunk=8, prompt=24, head=24, tail=16, steps=4, slots=6, capacity=128)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().cuda()
    contract = demo_contract(cfg, wrap=("encoder", "solver"))
    eps = export_catalog(model, contract, device="cuda")
    prog = cf.optimize(eps, contract, state=False)
    z = torch.zeros(1, cfg.chunk, cfg.dim, device="cuda")
    prog.warmup(z)
    assert prog.counters()["captures"] > 0
    state = list(model.initial_state(device="cuda"))
    out = prog(z, *state, z)
    assert all(t.is_cuda for t in out)
    c = prog.counters()
    assert c["replays"] > 0 and c["eager"] == 0, c
