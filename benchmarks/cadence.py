"""Conversations per GPU at a real-time cadence: N Token2Wav sessions, one 1 s chunk per second each.

    python benchmarks/cadence.py --cells SRc,stock --sessions 8,16,32 --stock-sessions 1,2,4 \\
        --seconds 60 --lanes 4 --json docs/results/cadence-h200.json

Released dimensions, random weights, fp32, the 0.1.2 driver (flow chunk + trim + stochastic HiFT).
Each session is one conversation: chunk k arrives at ``start + k`` seconds (starts staggered by
1/N s), and is late when its PCM is not on the host one second after it arrived (a playback
underrun: a deadline miss). Latency is arrival to PCM ready, so it includes queueing.

Cells, each in a fresh process:

- ``SRc``: one optimized program (chunk clock, one graph per solver step) with ``--lanes`` lanes,
  N sessions on it; worker threads (one per lane) serve the due chunks earliest first.
- ``stock``: the stock driver as it ships serves one conversation per model instance: one process
  per session (threads would share one default generator, so HiFT's draws, and the bytes, would
  depend on the neighbours; processes also escape the GIL, which the host-bound stock step needs).

Exactness: sessions follow ``--scripts`` conversation scripts (token stream and random seed);
every session's PCM stream must equal its script's solo stock run (same seed), bit for bit. Sessions
with one script run at different times beside different neighbours, so equal bytes also show the
isolation. Per N: p50/p99 latency, misses, peak memory, per-session memory and the cost of a join.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.token2wav import EXPORT_SEED, build_step, pick_device, release_unreferenced  # noqa: E402
from cadence_fx.determinism import pin_envelope, sha256_tensors  # noqa: E402

BUDGET_S = 1.0  # one chunk is one second of audio


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    sys.stderr.write(f"\r{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _script_tokens(step, spk, script: int, chunks: int):
    return step.fresh(chunks, spk, seed=10_000 + script)


def _solo_stock(step, state0: dict, spk, script: int, chunks: int) -> str:
    """A script's conversation alone through the stock code: the bytes every session of it must give."""
    torch.manual_seed(script)
    st = {k: v.to(spk.device, copy=True) for k, v in state0.items()}
    pcm = []
    for f in _script_tokens(step, spk, script, chunks):
        with torch.no_grad():
            out = step.driver_call(*step.next_args(f, st))
        pcm.append(out[0].cpu())
        st = step.carry(out)
    return sha256_tensors(pcm)


def _row(cell: str, n: int, lat: list[float], misses: int, chunks: int, **extra) -> dict:
    return dict(name=cell, n_sessions=n, p50_ms=harness.percentile(lat, 50), p99_ms=harness.percentile(lat, 99),
                p95_ms=harness.percentile(lat, 95), misses=misses, chunks=chunks, peak_mib=harness.peak_mib(),
                sha256="", **extra)


# --------------------------------------------------------------------------- SRc: sessions on one program
def run_sessions_cell(args) -> list[dict]:
    import cadence_fx as cf

    pin_envelope()
    device = pick_device()
    t2w, cfg, step, (tokens, mel, spk) = build_step(args, device)
    state0 = step.setup(tokens, mel, spk)
    chunks = int(args.seconds)
    t0 = time.perf_counter()
    solo = {s: _solo_stock(step, state0, spk, s, chunks) for s in range(args.scripts)}
    solo_s = time.perf_counter() - t0
    contract = t2w.token2wav_contract(cfg, "chunk", driver="0.1.2", step_segments=True)
    t0 = time.perf_counter()
    eps = t2w.export_step_catalog(step, state0, step.fresh(3, spk, seed=EXPORT_SEED),
                                  t2w.token2wav_contract(cfg, "step", driver="0.1.2"), granularity="step")
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    prog = cf.optimize(eps, contract, lanes=args.lanes)
    optimize_s = time.perf_counter() - t0
    del eps
    release_unreferenced(step, prog)
    state0 = {k: v.cpu() for k, v in state0.items()}
    first = step.fresh(1, spk)[0]
    warm = prog.warmup(*[first.get(n) for n in step.inputs])["seconds"]
    base = prog.memory_census()
    rows = []
    for n in args.sessions:
        harness.sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        # --join-live: each session joins when its first chunk arrives, while the others are streaming
        sessions = [None if args.join_live else prog.session(f"s{i}", seed=i % args.scripts) for i in range(n)]
        join_ms = (time.perf_counter() - t0) * 1e3 / n
        lat, pcm, misses, joins = _serve(prog, step, spk, state0, sessions, chunks, args, device)
        if joins:  # joined live: the join cost is the median of those joins
            join_ms = harness.percentile(joins, 50)
        exact = all(sha256_tensors(pcm[i]) == solo[i % args.scripts] for i in range(n))
        rows.append(_row("SRc", n, lat, misses, len(lat), bitexact=exact, lanes=args.lanes, join_ms=join_ms,
                         join_live=bool(joins),
                         per_session_mib=sessions[0].nbytes() / 2**20, warmup_s=warm, export_s=export_s,
                         optimize_s=optimize_s, solo_s=solo_s, script_sha={k: [v] for k, v in solo.items()},
                         census_mib={k: v / 2**20 for k, v in prog.memory_census().items()},
                         base_census_mib={k: v / 2**20 for k, v in base.items()}, counters=prog.counters()))
        print(f"[SRc N={n}] p50 {rows[-1]['p50_ms']:.0f} ms p99 {rows[-1]['p99_ms']:.0f} ms misses {misses} "
              f"exact {exact} peak {rows[-1]['peak_mib']}", file=sys.stderr, flush=True)
        for s in sessions:
            s.close()
        if misses and not args.full_sweep:
            break
    return rows


def _serve(prog, step, spk, state0, sessions, chunks: int, args, device: str):
    """Serve every session's chunks at their arrival times; returns (latencies ms, PCM per session, misses)."""
    n = len(sessions)
    fresh = [_script_tokens(step, spk, i % args.scripts, chunks) for i in range(n)]
    state = [{k: v.to(device, copy=True) for k, v in state0.items()} for _ in range(n)]
    pcm: list[list[torch.Tensor]] = [[] for _ in range(n)]
    lat: list[float] = []
    start = time.perf_counter() + 0.5
    due = [(start + i * BUDGET_S / n, i, 0) for i in range(n)]
    heapq.heapify(due)
    cond = threading.Condition()
    joins: list[float] = []
    done = [0]
    total = n * chunks

    def worker() -> None:
        stream = torch.cuda.Stream() if device == "cuda" else None
        while True:
            with cond:
                while not due and done[0] < total:
                    cond.wait()
                if not due:
                    return
                arrive, i, k = heapq.heappop(due)
            wait = arrive - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            with (torch.cuda.stream(stream) if stream is not None else _null()):
                with torch.no_grad():
                    if sessions[i] is None:
                        t_join = time.perf_counter()
                        sessions[i] = prog.session(f"s{i}", seed=i % args.scripts)
                        joins.append((time.perf_counter() - t_join) * 1e3)
                    out = sessions[i](*step.next_args(fresh[i][k], state[i]))
                wav = out[0].to("cpu")  # the PCM on the host: the chunk is ready
            ready = time.perf_counter()
            state[i] = step.carry(out)
            with cond:
                pcm[i].append(wav)
                lat.append((ready - arrive) * 1e3)
                done[0] += 1
                if k + 1 < chunks:
                    heapq.heappush(due, (arrive + BUDGET_S, i, k + 1))
                cond.notify_all()
                if done[0] % max(1, total // 50) == 0 or done[0] == total:
                    _progress(done[0], total, f"N={n}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers or len(prog.lanes.lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    misses = sum(x > BUDGET_S * 1e3 for x in lat)
    return lat, pcm, misses, joins


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- stock: one process per session
def run_stock_cell(args) -> list[dict]:
    rows = []
    for n in args.stock_sessions:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            go = tmp / "go"
            procs = []
            for i in range(n):
                cmd = [sys.executable, __file__, "--child", str(i), "--n", str(n), "--go", str(go),
                       "--out", str(tmp / f"s{i}.json"), "--seconds", str(args.seconds), "--scripts", str(args.scripts)]
                cmd += ["--reduced"] if args.reduced else []
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            while sum((tmp / f"s{i}.ready").exists() for i in range(n)) < n:  # every model built
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
            go.write_text(str(time.time() + 1.0))
            outs = [p.communicate() for p in procs]
            results = []
            for i, (p, (_o, err)) in enumerate(zip(procs, outs)):
                f = tmp / f"s{i}.json"
                if p.returncode != 0 or not f.exists():
                    rows.append(dict(name="stock", n_sessions=n, error=err[-3000:]))
                    break
                results.append(json.loads(f.read_text()))
            if len(results) < n:
                break
        lat = [x for r in results for x in r["lat"]]
        misses = sum(x > BUDGET_S * 1e3 for x in lat)
        digests = {}
        for i, r in enumerate(results):
            digests.setdefault(i % args.scripts, set()).add(r["sha"])
        rows.append(_row("stock", n, lat, misses, len(lat), bitexact=all(len(v) == 1 for v in digests.values()),
                         per_session_peak_mib=max(r["peak_mib"] or 0 for r in results),
                         script_sha={k: sorted(v) for k, v in digests.items()}))
        rows[-1]["peak_mib"] = sum(r["peak_mib"] or 0 for r in results)
        print(f"[stock N={n}] p50 {rows[-1]['p50_ms']:.0f} ms p99 {rows[-1]['p99_ms']:.0f} ms misses {misses}",
              file=sys.stderr, flush=True)
        if misses and not args.full_sweep:
            break
    return rows


def run_stock_child(args) -> None:
    pin_envelope()
    device = pick_device()
    t2w, cfg, step, (tokens, mel, spk) = build_step(args, device)
    state0 = step.setup(tokens, mel, spk)
    script = args.child % args.scripts
    chunks = int(args.seconds)
    fresh = _script_tokens(step, spk, script, chunks)
    Path(args.out).with_suffix(".ready").write_text("1")
    while not Path(args.go).exists():
        time.sleep(0.05)
    start = float(Path(args.go).read_text()) + args.child * BUDGET_S / args.n
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(script)
    st, pcm, lat = dict(state0), [], []
    for k, f in enumerate(fresh):
        arrive = start + k * BUDGET_S
        wait = arrive - time.time()
        if wait > 0:
            time.sleep(wait)
        with torch.no_grad():
            out = step.driver_call(*step.next_args(f, st))
        pcm.append(out[0].cpu())
        lat.append((time.time() - arrive) * 1e3)
        st = step.carry(out)
    Path(args.out).write_text(json.dumps(dict(lat=lat, sha=sha256_tensors(pcm), peak_mib=harness.peak_mib())))


# --------------------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="SRc,stock")
    ap.add_argument("--sessions", default="4,8,16,24,32,48,64", help="N for the SRc cell, ascending")
    ap.add_argument("--stock-sessions", default="1,2,4,6,8", help="N for the stock cell, ascending")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of audio (chunks) per session")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0, help="serving threads (default: one per lane)")
    ap.add_argument("--scripts", type=int, default=4)
    ap.add_argument("--full-sweep", action="store_true", help="keep sweeping N after the first misses")
    ap.add_argument("--join-live", action="store_true",
                    help="each session joins when its first chunk arrives (during the others' traffic)")
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (CPU smoke run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lane", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sessions = [int(x) for x in str(args.sessions).split(",") if x]
    args.stock_sessions = [int(x) for x in str(args.stock_sessions).split(",") if x]
    if args.child is not None:
        return run_stock_child(args)
    if args.one:
        rows = run_sessions_cell(args) if args.one == "SRc" else run_stock_cell(args)
        return harness.write_cell(args.out, rows)
    passthrough = _strip(sys.argv[1:], ("--json", "--cells"))
    rows = harness.run_cells(__file__, [[c for c in args.cells.split(",") if c]], passthrough)
    env = pin_envelope()
    report = dict(command="python benchmarks/cadence.py " + " ".join(sys.argv[1:]), torch=torch.__version__,
                  device=env.get("device"), date=time.strftime("%Y-%m-%d"), rows=rows)
    # the stock processes are solo runs of their scripts: their bytes must be the SRc cell's solo bytes too
    solo = {str(k): v for r in rows if r.get("name") == "SRc" and "script_sha" in r for k, v in r["script_sha"].items()}
    for r in rows:
        if r.get("name") == "stock" and "script_sha" in r and solo:
            r["bitexact"] = r["bitexact"] and all(v == solo.get(str(k)) for k, v in r["script_sha"].items())
    for r in rows:
        if "error" in r:
            print(f"{r['name']}: FAILED\n{r['error']}", file=sys.stderr)
            continue
        print(f"{r['name']:<6} N={r['n_sessions']:>3}  p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
              f"misses {r['misses']:>4}/{r['chunks']}  peak {r['peak_mib'] or 0:9.0f} MiB  exact {r['bitexact']}")
    if args.json:
        harness.write_json(args.json, report)


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
