"""Shared test helpers: run the unmodified and the optimized program side by side."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import cadence_fx as cf
from cadence_fx.determinism import sha256_tensors


sha256 = sha256_tensors  # the library's own stream hash


def program_for(eps) -> Callable:
    """The unmodified exported programs, dispatched by signature, run under no_grad (the library's own)."""
    return cf.reference(eps)


def run_streams(eps, prog, make_inputs, state, region_out: dict[int, int], calls: int, *, restore_at=None,
                ref_eps=None):
    """Run ``calls`` steps of the reference and the optimized program from the same state.

    ``make_inputs(k, state)`` builds call k's inputs; ``region_out`` maps input index -> output index
    of each state region. Returns (reference outputs per call, optimized outputs per call, data pointers).
    Outputs are cloned immediately, as a consumer would read them. ``ref_eps`` (exported from a copy
    of the model) keeps the reference's module buffers apart from the optimized program's.
    """
    ref_call = program_for(ref_eps if ref_eps is not None else eps)
    ref_state = [s.clone() for s in state]
    opt_state = list(state)
    refs, opts, ptrs = [], [], []
    for k in range(calls):
        if restore_at is not None and k == restore_at:
            snap = [s.clone() for s in ref_state]  # a turn boundary: restore both from a snapshot
            ref_state, opt_state = [s.clone() for s in snap], [s.clone() for s in snap]
        r = ref_call(*make_inputs(k, ref_state))
        r = [t.clone() for t in r]
        o = prog(*make_inputs(k, opt_state))
        ptrs.append([o[j].data_ptr() for j in region_out.values()])
        opts.append([t.clone() for t in o])
        refs.append(r)
        for slot, (i, j) in enumerate(region_out.items()):
            ref_state[slot] = r[j]
            opt_state[slot] = o[j]
    return refs, opts, ptrs


def live_view(outputs, live: dict[int, dict[int, int]]):
    """Restrict state outputs with dead stock capacity to their live extent (output index -> {dim: n})."""
    out = list(outputs)
    for j, dims in live.items():
        for d, n in dims.items():
            out[j] = out[j].narrow(d, 0, n)
    return out


def demo_catalog(cfg=None):
    """The demo decoder (seed 0), its contract and its exported catalog: (model, contract, eps)."""
    import torch

    from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

    cfg = cfg or DemoConfig()
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval()
    contract = demo_contract(cfg)
    return model, contract, export_catalog(model, contract)


def demo_inputs(cfg, seed: int, k: int):
    """Call ``k`` of conversation ``seed`` on the demo decoder: (tokens, noise), seeded on the host."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + k)
    return torch.randn(1, cfg.chunk, cfg.dim, generator=g), torch.randn(1, cfg.chunk, cfg.dim, generator=g)


def demo_call(fn, cfg, seed: int, k: int, state):
    """``fn`` (a program, a session or the reference) on call ``k`` of conversation ``seed``."""
    tok, noise = demo_inputs(cfg, seed, k)
    return fn(tok, *state, noise)


def run_bench_report(cmd: list[str], out: Path, *, timeout: float) -> dict[str, Any]:
    """Run a benchmark script (``cmd``) with this checkout on its path, and its JSON report ``out``:
    written, without an ``error``, and the process exited 0 (each failure says what it printed)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert "error" not in rep, rep["error"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return rep
