"""Token2Wav (MiniCPM-o 4.5 / Step-Audio2 streaming decoder): the factorial benchmark.

    python benchmarks/token2wav.py --blocks 4 --chunks 24 --json docs/results/token2wav-h200.json

Released dimensions, random weights, fp32, prompt of 151 tokens, 28-token chunks, the 0.1.2 driver
(flow chunk + stock trim + stochastic HiFT). Cells:

- ``B0``     the stock eager code as shipped (``flow.inference_chunk`` + trim + HiFT);
- ``vendor`` the same with the vendor CUDA-graph branch enabled (``scatter_cuda_graph(True)``);
  the benchmark counts whether it ever fires;
- ``S``      state rule only (no replay);
- ``R``/``Rc``   replay at the step / chunk clock without the state rule;
- ``SR``/``SRc`` both rules.

Every block runs every cell from the same seed and token stream; the last block restores all
caches from a snapshot mid-stream (a turn boundary). A cell whose PCM bytes differ from B0's in
the same block is NOT EXACT and gets no speedup. Peak is the allocator's peak over the cell
(weights, region buffers, workspaces, graphs and staging included).

Process layout: the stock cells run in one fresh process; all optimized cells share one fresh
process (one export of the catalog serves both clocks). Each optimized cell is built from scratch
(optimize, warm-up capture of the whole catalog, reported), streams every block, and is torn down
(program deleted, cache emptied, peak reset) before the next; the stock module's buffers that the
optimized program does not reference (its workspaces) are released while the cell runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import table  # noqa: E402
from cadence_fx.determinism import pin_envelope, sha256_tensors  # noqa: E402
from cadence_fx.measure import count_launches, peak_mib, sync  # noqa: E402

OPT_CELLS = {
    "S": dict(state=True, replay="off", granularity="chunk"),
    "R": dict(state=False, replay="auto", granularity="step"),
    "Rc": dict(state=False, replay="auto", granularity="chunk"),
    "SR": dict(state=True, replay="auto", granularity="step"),
    "SRc": dict(state=True, replay="auto", granularity="chunk"),
}
RESTORE_SNAPSHOT, RESTORE_AT = 8, 12


def _build(args):
    from cadence_fx.adapters import token2wav as t2w
    from cadence_fx.adapters.upstream import load_stepaudio2

    root = Path(os.environ.get("CADENCE_FX_UPSTREAM", ROOT / ".upstream")) / "minicpmo-0.1.2"
    up = load_stepaudio2(root)
    cfg = t2w.Token2WavConfig.reduced() if args.reduced else t2w.Token2WavConfig()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    flow = t2w.build_flow(up, cfg)
    hift = t2w.build_vocoder(up, cfg)
    step = t2w.Token2WavStep(flow, hift, cfg, driver="0.1.2").to(device).eval()
    tokens, mel, spk = (t.to(device) for t in t2w.example_prompt(cfg))
    state0 = step.setup(tokens, mel, spk)
    return t2w, cfg, step, state0, spk, device


def _stream(fn, step, state0, fresh, seed: int, restore: bool, profile: bool):
    """Run one block; return (per-chunk ms, PCM sha256, launches, kernels)."""
    torch.manual_seed(seed)
    st = {k: v.clone() for k, v in state0.items()}
    pcm, ms, snapshot = [], [], None
    for k, f in enumerate(fresh):
        if restore and k == RESTORE_AT:
            st = {n: t.clone() for n, t in snapshot.items()}  # foreign tensors: a turn boundary
        args = step.next_args(f, st)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn(*args)
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
        pcm.append(out[0].detach().clone())
        st = step.carry(out)
        if restore and k == RESTORE_SNAPSHOT:
            snapshot = {n: t.clone() for n, t in st.items()}
    launches = kernels = float("nan")
    if profile:  # one extra call after the timed stream, so profiling never distorts a timing
        args = step.next_args(fresh[-1], st)
        launches, kernels = count_launches(lambda: fn(*args), calls=1)
    return ms, sha256_tensors(pcm), launches, kernels


def _row(name, block, ms, sha, peak, launches, kernels, warm, notes=""):
    xs = sorted(ms)
    return dict(name=name, block=block, p50_ms=xs[len(xs) // 2], p95_ms=xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))],
                peak_mib=peak, kernels_per_chunk=kernels, launches_per_chunk=launches, warmup_s=warm, sha256=sha,
                notes=notes, ms=ms)


def run_stock(args) -> list[dict]:
    env = pin_envelope()
    t2w, cfg, step, state0, spk, device = _build(args)
    rows = []
    # the envelope check: the stock code must reproduce its own bytes before any comparison
    fresh = step.fresh(args.chunks, spk, seed=0)
    a = _stream(step.stock_call, step, state0, fresh, 1000, False, False)[1]
    b = _stream(step.stock_call, step, state0, fresh, 1000, False, False)[1]
    rows.append(dict(name="envelope", reproducible=a == b, envelope={k: str(v) for k, v in env.items()},
                     gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__))
    for block in range(args.blocks):
        fresh = step.fresh(args.chunks, spk, seed=block)
        restore = block == args.blocks - 1
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms, sha, la, kn = _stream(step.stock_call, step, state0, fresh, 1000 + block, restore, block == 0)
        rows.append(_row("B0", block, ms, sha, peak_mib(), la, kn, 0.0, "restore" if restore else ""))
    if device == "cuda" and "vendor" in args.cells:
        fires = _vendor_fires(step)
        fresh = step.fresh(args.chunks, spk, seed=0)
        torch.cuda.reset_peak_memory_stats()
        ms, sha, la, kn = _stream(step.stock_call, step, state0, fresh, 1000, False, True)
        rows.append(_row("vendor", 0, ms, sha, peak_mib(), la, kn, 0.0,
                         f"vendor graph replays: {fires['n']} (buckets {sorted(step.flow.decoder.estimator.graph_chunk)})"))
    return rows


def _vendor_fires(step) -> dict:
    """Enable the vendor branch as shipped and count its graph replays."""
    dit = step.flow.decoder.estimator
    step.flow.scatter_cuda_graph(True)
    fires = {"n": 0}

    class Counting:
        def __init__(self, g):
            self.g = g

        def replay(self):
            fires["n"] += 1
            self.g.replay()

    for k in list(dit.graph_chunk):
        dit.graph_chunk[k] = Counting(dit.graph_chunk[k])
    return fires


def run_opt(args) -> list[dict]:
    import cadence_fx as cf

    pin_envelope()
    t2w, cfg, step, state0, spk, device = _build(args)
    t0 = time.perf_counter()
    contracts = {g: t2w.token2wav_contract(cfg, g, driver="0.1.2") for g in ("chunk", "step")}
    # the "step" routing installs both the CFM-loop and the estimator proxies, so one export
    # serves both clocks; the contract's wrap list picks the granularity
    eps = t2w.export_step_catalog(step, state0, step.fresh(len(cf.call_classes(contracts["step"])), spk, seed=99),
                                  contracts["step"], granularity="step")
    export_s = time.perf_counter() - t0
    print(f"exported {len(eps)} programs in {export_s:.1f} s", file=sys.stderr, flush=True)
    rows = []
    cells = [c for c in args.cells.split(",") if c in OPT_CELLS]
    freed: list = []
    for name in cells:
        spec = OPT_CELLS[name]
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        for buf, nbytes, saved in freed:  # the exported programs still name the stock buffers
            buf.untyped_storage().resize_(nbytes)
            buf.copy_(saved)
        t1 = time.perf_counter()
        prog = cf.optimize(eps, contracts[spec["granularity"]], replay=spec["replay"], state=spec["state"])
        optimize_s = time.perf_counter() - t1
        freed = _release_unreferenced(step, prog)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        # one program per cell, captured once; every block streams through it from the block's seed
        warm = prog.warmup(*step.next_args(step.fresh(1, spk)[0], state0))["seconds"]
        for block in range(args.blocks):
            fresh = step.fresh(args.chunks, spk, seed=block)
            restore = block == args.blocks - 1
            before = prog.counters()
            ms, sha, la, kn = _stream(prog, step, state0, fresh, 1000 + block, restore, block == 0)
            c = prog.counters()
            notes = (f"replays {c['replays'] - before['replays']}, eager {c['eager'] - before['eager']} "
                     f"{c['rejections'] or ''}" + (", restore" if restore else ""))
            rows.append(_row(name, block, ms, sha, peak_mib(), la, kn, warm, notes))
            rows[-1]["passes"] = prog.stats["passes"]
            rows[-1]["optimize_s"] = optimize_s
            print(f"[{name} block {block}] p50 {rows[-1]['p50_ms']:.1f} ms peak {rows[-1]['peak_mib']} {notes} "
                  f"(optimize {optimize_s:.1f} s, warm-up {warm:.1f} s)", file=sys.stderr, flush=True)
        del prog
        if args.out:  # written after every cell: a run cut short still reports what it measured
            Path(args.out).write_text(json.dumps(rows + [dict(name="export", seconds=export_s)]))
    rows.append(dict(name="export", seconds=export_s))
    return rows


def _release_unreferenced(step, prog) -> list:
    """Free the stock module's buffers that no optimized program references (its workspaces).

    The optimized program owns demand-sized copies; in a deployment the stock module would be
    dropped after export. Only storages no graph attribute of ``prog`` points at are released.
    """
    used = set()
    for gm in prog.graph_modules():
        for mod in gm.modules():
            for t in list(mod._buffers.values()) + list(mod._parameters.values()):
                if isinstance(t, torch.Tensor):
                    used.add(t.untyped_storage().data_ptr())
    freed = []
    for _name, buf in step.named_buffers():
        storage = buf.untyped_storage()
        if storage.data_ptr() not in used and storage.nbytes() > 1 << 20:
            freed.append((buf, storage.nbytes(), buf.detach().to("cpu", copy=True)))
            storage.resize_(0)
    return freed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--cells", default="B0,vendor,S,R,Rc,SR,SRc")
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (CPU smoke run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--group", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="*", default=None, help="print the table of saved group results")
    args = ap.parse_args()
    if args.group:
        rows = run_stock(args) if args.group == "stock" else run_opt(args)
        Path(args.out).write_text(json.dumps(rows))
        return
    rows: list[dict] = []
    if args.merge is not None:
        for f in args.merge:
            rows += json.loads(Path(f).read_text())
        report(rows, args)
        return
    passthrough = ["--blocks", str(args.blocks), "--chunks", str(args.chunks), "--cells", args.cells]
    passthrough += ["--reduced"] if args.reduced else []
    for group in ("stock", "opt"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            proc = subprocess.run([sys.executable, __file__, "--group", group, "--out", str(out), *passthrough],
                                  capture_output=True, text=True)
            sys.stderr.write(proc.stderr[-4000:])
            if proc.returncode != 0:
                print(f"group {group} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", file=sys.stderr)
                continue
            rows += json.loads(out.read_text())
    report(rows, args)


def report(rows: list[dict], args) -> None:
    """Gate exactness against B0 per block, print the table and the per-cell summary, save JSON."""
    cells = [r for r in rows if "p50_ms" in r]
    base = {r["block"]: r for r in cells if r["name"] == "B0"}
    for r in cells:
        b = base.get(r["block"])
        r["bitexact"] = b is not None and r["sha256"] == b["sha256"]
        r["speedup"] = b["p50_ms"] / r["p50_ms"] if r["bitexact"] and r["name"] != "B0" else (
            1.0 if r["name"] == "B0" else None)
    env = next((r for r in rows if r["name"] == "envelope"), {})
    exp = next((r for r in rows if r["name"] == "export"), {})
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None) or (
        torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print(f"Token2Wav {'reduced' if args.reduced else 'released'} sizes, {args.blocks} blocks x {args.chunks} chunks, "
          f"{gpu}, torch {env.get('torch', torch.__version__)}, {date.today()}; baseline reproduces itself under the envelope: "
          f"{env.get('reproducible')}; export of the catalog: {exp.get('seconds', float('nan')):.1f} s")
    print(table(cells))
    summary = {}
    for name in dict.fromkeys(r["name"] for r in cells):
        rs = [r for r in cells if r["name"] == name]
        summary[name] = dict(p50_ms=sorted(r["p50_ms"] for r in rs)[len(rs) // 2],
                             peak_mib=max((r["peak_mib"] or 0) for r in rs),
                             bitexact_blocks=f"{sum(r['bitexact'] for r in rs)}/{len(rs)}")
    print("per-cell medians over blocks:", json.dumps(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = [dict(name=r["name"], block=r["block"], p50_ms=r["p50_ms"], p95_ms=r["p95_ms"], peak_mib=r["peak_mib"],
                       kernels_per_chunk=r["kernels_per_chunk"], launches_per_chunk=r["launches_per_chunk"],
                       warmup_s=r["warmup_s"], sha256=r["sha256"], bitexact=r["bitexact"], notes=r["notes"],
                       ms=r["ms"]) for r in cells]
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, torch=env.get("torch", torch.__version__), date=str(date.today()),
                                                   envelope=env, export_s=exp.get("seconds"), cells=result,
                                                   summary=summary), indent=1))


if __name__ == "__main__":
    main()
