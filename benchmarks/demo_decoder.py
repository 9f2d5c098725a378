"""Factorial benchmark on the demo decoder: eager vs. state rule vs. replay vs. both, in one process.

    python benchmarks/demo_decoder.py --calls 40 --json docs/results/demo-<gpu>.json

Cells: B0 (the unmodified exported program, eager), S (state rule), R / Rc (replay at the step /
chunk clock without the state rule), SR / SRc (both). A cell whose output bytes differ from B0's
is reported as not exact and gets no speedup.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cadence_fx as cf  # noqa: E402
from cadence_fx.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog  # noqa: E402
from cadence_fx.determinism import pin_envelope  # noqa: E402
from cadence_fx.measure import count_launches, peak_mib, time_stream  # noqa: E402

CELLS = {
    "B0": None,
    "S": dict(state=True, replay="off", wrap=("encoder", "solver")),
    "R": dict(state=False, replay="auto", wrap=("encoder", "solver.estimator")),
    "Rc": dict(state=False, replay="auto", wrap=("encoder", "solver")),
    "SR": dict(state=True, replay="auto", wrap=("encoder", "solver.estimator")),
    "SRc": dict(state=True, replay="auto", wrap=("encoder", "solver")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    envelope = pin_envelope()
    cfg = DemoConfig(dim=args.dim, chunk=50, prompt=302, head=302, tail=100, steps=10, slots=16, capacity=1000,
                     kernel=3)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().to(device)
    base_contract = demo_contract(cfg)
    eps = export_catalog(model, base_contract, device=device)
    modules = {}
    for ep in eps:
        phs = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        modules[tuple(tuple(phs[n].meta["val"].shape) for n in ep.graph_signature.user_inputs)] = ep.module()

    def eager(*a):
        return modules[tuple(tuple(x.shape) for x in a)](*a)

    inputs = []
    g = torch.Generator().manual_seed(42)
    for _ in range(args.calls):
        inputs.append((torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device),
                       torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device)))

    rows = []
    b0_sha = None
    b0_p50 = None
    for name in args.cells.split(","):
        spec = CELLS[name]
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        warm = 0.0
        if spec is None:
            fn = eager
        else:
            contract = demo_contract(cfg, wrap=spec["wrap"])
            prog = cf.optimize(eps, contract, replay=spec["replay"], state=spec["state"])
            enc, est, conv = model.initial_state(device=device)
            warm = prog.warmup(inputs[0][0], enc, est, conv, inputs[0][1])["seconds"]
            fn = prog
        state = list(model.initial_state(device=device))

        def step(k, fn=fn, state=state):
            out = fn(inputs[k][0], state[0], state[1], state[2], inputs[k][1])
            state[0], state[1], state[2] = out[1], out[2], out[3]
            return out

        res = time_stream(step, args.calls, emitted=lambda out: [out[0]])
        res.peak_mib = peak_mib()
        launches, kernels = count_launches(lambda: step(args.calls - 1), calls=3)
        counters = fn.counters() if spec is not None else {}
        exact = b0_sha is None or res.sha256 == b0_sha
        if name == "B0":
            b0_sha, b0_p50 = res.sha256, res.p50
        rows.append(dict(name=name, p50_ms=res.p50, p95_ms=res.p(95), peak_mib=res.peak_mib,
                         launches_per_call=launches, kernels_per_call=kernels, warmup_s=warm, sha256=res.sha256,
                         bitexact=exact, speedup=(b0_p50 / res.p50) if exact and b0_p50 else None,
                         replays=counters.get("replays"), eager_fallbacks=counters.get("eager"),
                         rejections=counters.get("rejections")))
        del fn
    print(f"demo decoder, dim {cfg.dim}, chunk {cfg.chunk}, {cfg.steps} solver steps, {args.calls} calls, "
          f"{device} ({torch.cuda.get_device_name() if device == 'cuda' else platform.processor()}), torch "
          f"{torch.__version__}, envelope cudnn.deterministic={envelope.get('cudnn.deterministic')}")
    print(f"{'cell':<5}{'p50 ms':>9}{'p95 ms':>9}{'peak MiB':>10}{'launches':>10}{'kernels':>9}{'warmup s':>10}"
          f"{'exact':>7}{'speedup':>9}  fallbacks")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else ("n/a" if r["bitexact"] else "NOT EXACT")
        pk = f"{r['peak_mib']:.1f}" if r["peak_mib"] is not None else "n/a"
        print(f"{r['name']:<5}{r['p50_ms']:>9.2f}{r['p95_ms']:>9.2f}{pk:>10}{r['launches_per_call']:>10.0f}"
              f"{r['kernels_per_call']:>9.0f}{r['warmup_s']:>10.2f}{str(r['bitexact']):>7}{sp:>9}  "
              f"{r['eager_fallbacks']} {r['rejections'] or ''}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = dict(date=str(date.today()), torch=torch.__version__, device=device,
                    gpu=torch.cuda.get_device_name() if device == "cuda" else None, envelope=envelope,
                    config=dict(dim=cfg.dim, chunk=cfg.chunk, steps=cfg.steps, calls=args.calls))
        Path(args.json).write_text(json.dumps(dict(meta=meta, cells=rows), indent=1, default=str))


if __name__ == "__main__":
    main()
