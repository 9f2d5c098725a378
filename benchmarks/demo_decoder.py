"""Factorial benchmark on the demo decoder: eager vs. state rule vs. replay vs. both.

    python benchmarks/demo_decoder.py --calls 40 --json docs/results/demo-<gpu>.json

Cells: B0 (the unmodified exported program, eager), S (state rule), R / Rc (replay at the step /
chunk clock without the state rule), SR / SRc (both). Every (block, cell) runs in a fresh process
(``benchmarks/harness.py``); a cell whose output bytes differ from B0's is reported as not exact and
gets no speedup. Without a GPU it runs on the CPU (timings, no peak or launch counts).
"""

from __future__ import annotations

import argparse
import platform
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cadence_fx as cf  # noqa: E402
from benchmarks import harness  # noqa: E402
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog  # noqa: E402
from cadence_fx.determinism import describe_envelope, pin_envelope  # noqa: E402
from cadence_fx.runtime.catalog import reference  # noqa: E402

CELLS = {
    "B0": None,
    "S": dict(state=True, replay="off", wrap=("encoder", "solver")),
    "R": dict(state=False, replay="auto", wrap=("encoder", "solver.estimator")),
    "Rc": dict(state=False, replay="auto", wrap=("encoder", "solver")),
    "SR": dict(state=True, replay="auto", wrap=("encoder", "solver.estimator")),
    "SRc": dict(state=True, replay="auto", wrap=("encoder", "solver")),
}


def run_one(cell: str, calls: int, dim: int) -> dict:
    """One cell in this (fresh) process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pin_envelope()
    envelope = describe_envelope()
    cfg = DemoConfig(dim=dim, chunk=50, prompt=302, head=302, tail=100, steps=10, slots=16, capacity=1000,
                     kernel=3)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().to(device)
    spec = CELLS[cell]
    contract = demo_contract(cfg, wrap=spec["wrap"] if spec else ())
    eps = export_catalog(model, contract, device=device)
    g = torch.Generator().manual_seed(42)
    inputs = [(torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device),
               torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device)) for _ in range(calls)]
    warm, counters = 0.0, {}
    if spec is None:
        fn = reference(eps)
    else:
        fn = cf.optimize(eps, contract, replay=spec["replay"], state=spec["state"])
        warm = fn.warmup(inputs[0][0], *model.initial_state(device=device), inputs[0][1])["seconds"]
    state = list(model.initial_state(device=device))

    def step(k):
        out = fn(inputs[k][0], state[0], state[1], state[2], inputs[k][1])
        state[0], state[1], state[2] = out[1], out[2], out[3]
        return out

    res = harness.time_stream(step, calls, emitted=lambda out: [out[0]])
    res.peak_mib = harness.peak_mib()
    launches, kernels = harness.count_launches(lambda: step(calls - 1), calls=3)
    if spec is not None:
        counters = fn.counters()
    return dict(name=cell, p50_ms=res.p50, p95_ms=res.p95, peak_mib=res.peak_mib, kernels_per_chunk=kernels,
                launches_per_chunk=launches, warmup_s=warm, sha256=res.sha256,
                notes=f"fallbacks {counters.get('eager')} {counters.get('rejections') or ''}" if counters else "",
                envelope={k: str(v) for k, v in envelope.items()}, device=device,
                gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                torch=torch.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--dim", type=int, default=256)
    harness.add_flags(ap, cells=",".join(CELLS), blocks=1)
    args = ap.parse_args()
    if args.one:
        harness.write_cell(args.out, run_one(args.one, args.calls, args.dim))
        return
    rows = harness.collect(args, __file__, ["--calls", str(args.calls), "--dim", str(args.dim)], per_block=True)
    ok = next((r for r in rows if "error" not in r), {})
    print(f"demo decoder: dim {args.dim}, chunk 50, 10 solver steps, {args.calls} calls per cell, fresh process "
          f"per cell; {ok.get('device')} {ok.get('gpu')}, torch {ok.get('torch')}, {date.today()}")
    print(harness.table(rows))
    if args.json:
        harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
