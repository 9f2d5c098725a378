"""Conversations per GPU at a real-time cadence: N Token2Wav sessions, one 1 s chunk per second each.

    python benchmarks/cadence.py --cells SRc,stock --gpus 1 --sessions 38,40 --stock-sessions 12,14 \\
        --lanes 8 --warm-seconds 5 --json docs/results/cadence-h200.json

Released dimensions, random weights, fp32 (``--dtype float16``: the float16 path of the Token2Wav
build, where this checkout has one), the 0.1.2 driver (flow chunk + trim + stochastic HiFT). Each
session is one conversation: chunk k of session i (of N) arrives at ``t0 + i/N + k`` seconds, and is
late when its PCM is not on the host one second after it arrived (a playback underrun: a deadline
miss). Latency is arrival to PCM ready, so it includes queueing. ``--seconds`` (default 60) is the
length of every conversation, so every N runs that long.

GPUs (``--gpus``, a list: default every visible GPU, or 1 without CUDA). For ``g`` GPUs, session i
is placed on GPU ``i % g`` (round robin; the global stagger makes each GPU's arrivals ``g/N`` s
apart). Every process that serves sessions sees one GPU (``CUDA_VISIBLE_DEVICES``); all of them
start a run at one wall-clock ``t0`` chosen by the coordinator (this process, which never touches a
GPU), so every arrival is on the same 1 s grid, and the coordinator merges their per-chunk latencies
into one row per (cell, gpus, N). ``--sessions`` takes one list of N per entry of ``--gpus``,
separated by '/' (``16,17,18/32,34,36``), or one list: the N of the first GPU count, scaled for the
others. Each list is
swept upward and stops at the first N with misses (``--full-sweep``: keep going); the report's
``limits`` give, per cell and GPU count, the largest N without a miss and the ratio of the largest
GPU count's limit to one GPU's.

Cells, in one run:

- ``SRc``: one optimized program (chunk clock, one graph per solver step) with ``--lanes`` lanes per
  GPU; worker threads (one per lane) serve the due chunks earliest first. One long-lived worker
  process per GPU builds the model from the benchmark seed (so every GPU holds the same weights),
  exports the catalog and optimizes it once, in parallel with the others, then serves one N after
  another. Before its first measured row every worker serves an untimed warm stream of
  ``--warm-seconds`` (default 10 s on GPUs, 0: none) at the first N it will serve (its share of that
  row's sessions, joined as that row joins them), so the allocator's growth to that many sessions,
  lazy cuBLAS/cuDNN set-up and first replays fall in no measured row; the report keeps it as
  ``warm_s`` and ``setup.SRc.warm``, not as a row. ``--pack`` runs rows that need fewer GPUs than
  there are side by side on disjoint GPUs, and only rows of the same N (with ``--gpus 1,2``: N=16 on
  GPU 0 and N=16 on GPU 1, two independent one-GPU rows, a repeat; ``repeat`` numbers them and
  ``concurrent_n`` names the neighbours' N). Rows of different N are never packed, so a row never
  shares the host with a larger, overloaded one (session 5 packed N=16 beside N=17 and neither row was
  credible). Each row still has its GPUs to itself; the host's CPUs are shared, as they are in the
  two-GPU rows. An N counts as clean in ``limits`` only when every repeat of it is.
  ``--procs-per-gpu P`` runs P worker processes on every GPU instead of one, each with ``--lanes``
  lanes and an interpreter of its own (one process's serving threads share one interpreter lock, and
  its draws one lock: the host bound of float16 and Moshi rows); a GPU's sessions are dealt round
  robin over its processes, and the row (labelled ``SRc/Pp``) pools them: latencies, digests, peak
  memory summed, and a busy fraction that is the union of the processes' kernel intervals
  (``per_device``). With ``--artifact`` not yet saved, slot 0 of each GPU builds and saves it and the
  other slots load it once slot 0 is ready. Without MPS the processes' contexts take turns on the GPU;
  ``--mps`` starts an MPS daemon of the run's own for the workers (``benchmarks/cadence_mps.py``,
  rows labelled ``+mps``; the report's ``setup.mps`` says whether one ran, and why not).
- ``stock``: the stock driver as it ships serves one conversation per model instance: one process per
  session, pinned to GPUs round robin (threads would share one default generator, so HiFT's draws,
  and the bytes, would depend on the neighbours; processes also escape the GIL, which the host-bound
  stock step needs). Each row has processes of its own, one per session, built when the row comes
  (:class:`StockRow`): a stock process left idle on the GPU slowed the rows beside it, though it
  submits nothing. Each process gets ``cpu_count // N`` intra-op threads: N processes with a thread
  per core each would oversubscribe the host N times.

Exactness: sessions follow ``--scripts`` conversation scripts (token stream and random seed). Before
any cell, one process per GPU runs its share of the scripts alone through the stock code (the solo
runs, in parallel with the SRc workers' builds); every session's PCM stream, in every cell, must
equal its script's solo run bit for bit (``bitexact``). Sessions of one script run at different times
beside different neighbours (and, with more than one GPU, on another GPU than the solo run), so equal
bytes also show the isolation.

Per row: p50/p95/p99 latency, misses, peak memory (``torch.cuda.max_memory_allocated`` of every
serving process, summed over GPUs; per GPU in ``per_gpu``), GPU busy fraction, and the cost of a join.

- GPU busy fraction (``busy_fraction``, SRc): in each worker process a ``torch.profiler`` window
  (CUDA activity only, so no host-side op recording) of ``--busy-window`` seconds (default 1), ending
  at the last arrival (every second of arrivals brings one chunk of every session, the last one
  too). The kernel intervals it records, on every lane's stream, are clipped to the window and
  merged (their union, not their sum: lanes overlap), then divided by the window. Memcpy and memset
  are not kernels and are not counted. The row gives the mean over GPUs and ``busy_per_gpu``. The
  profiler is stopped only after the run (stopping parses the trace with the GIL held, which would
  stall the serving threads), so CUPTI is on from the window's start until the last chunk is
  served; ``misses_while_profiling`` counts the misses among the chunks ready after the window
  opened (where tracing could have caused one).
  ``--busy-window 0`` turns it off.
- ``nvml_util`` (both cells, where pynvml is importable): NVML's utilization ("percent of time over
  the past sample period during which one or more kernels was executing"), sampled every 0.5 s by the
  coordinator over the run, mean over samples and GPUs; device-wide, so it covers the stock cell's
  many processes too.
- Joins: with ``--join-live`` each session joins when its first chunk arrives, during the others'
  traffic; ``join_p50_ms``/``join_max_ms`` are the cost of those joins (``prog.session``), and
  ``join_window_misses`` counts the other sessions' chunks on the same GPU that were pending at a
  join or arrived in the second after it (arrival in ``(t_join - 1 s, t_join + 1 s]``) and missed.
  Without it, sessions join before the traffic and the join cost is the mean of those joins.

``--model demo`` swaps Token2Wav for the small demo decoder (``cadence_fx.testing.demo_model``), with
``--period`` shorter than 1 s: the CPU smoke test of the multi-process path, not a measurement.

``--model moshi`` (``benchmarks/cadence_moshi.py``): a session is a Moshi full-duplex conversation at an
80 ms cadence (``--period`` defaults to 0.08 for it): every frame, Mimi encode + ``LMGen`` step + Mimi
decode, through one session of each of the three optimized programs (``--lanes`` lanes each); its
bytes (every frame's tokens, then its PCM) must equal its script's solo stock run. The stock cell is
the vendor's layout, one conversation per process (the server's warm-up and ``reset_streaming``,
moshi's ``CUDAGraphed`` as shipped); ``--solo-stock eager`` takes the solo digests from the eager stock
code instead. Wired, not yet measured on a GPU (docs/benchmarks.md).

``--model code2wav`` (``benchmarks/cadence_code2wav.py``): a session is Qwen3-Omni's Code2Wav decoding a
conversation's codes as a streaming server does, ``--code2wav-chunk`` frames per chunk (default 25: 2 s
of audio, so ``--period`` defaults to 2 s) with ``--code2wav-context`` frames of context (default 24, the
longest the step's contract allows at 25); ``--reduced`` (or ``--tiny``) for the adapter's TINY sizes,
``--dtype float32`` or ``bfloat16``. The stock cell is the step's eager forward (one chunk of upstream
``chunked_decode``), one conversation per process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cadence_code2wav as code2wav  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.cadence_exact import run_solo_child  # noqa: E402
from benchmarks.cadence_measure import BusyWindow, busy_fraction, gpu_name, timeline, union_length  # noqa: E402
from benchmarks.cadence_model import dtype_hook  # noqa: E402
from benchmarks.cadence_rows import limits, merge_row, table  # noqa: E402
from benchmarks.cadence_run import Run, draw_replay_modes  # noqa: E402
from benchmarks.cadence_stock import run_stock_child  # noqa: E402
from benchmarks.cadence_worker import run_worker, worker_env  # noqa: E402

# this script is the entry point; these are what it is made of, by job (also reached as cadence.NAME):
# cadence_model (what a process builds), cadence_traffic (scripts, the deadline clock),
# cadence_placement (GPUs, sessions, starting children), cadence_worker (the SRc process),
# cadence_stock (the stock processes), cadence_measure (busy fraction, NVML, timelines),
# cadence_exact (solo digests, the gate), cadence_rows (rows, limits, the table), cadence_run (Run)
__all__ = ["BusyWindow", "Run", "busy_fraction", "dtype_hook", "limits", "main", "merge_row", "parser",
           "per_gpu_lists", "table", "timeline", "union_length", "worker_env"]


def per_gpu_lists(spec: str, gpus: list[int]) -> dict[int, list[int]]:
    """``--sessions``: one comma list per GPU count ('/'-separated), or one list, which is the N of the
    smallest GPU count and is scaled for the others (``16,18`` with ``--gpus 1,2``: 16,18 and 32,36)."""
    groups = str(spec).split("/")
    if len(groups) == 1:
        base = [int(x) for x in groups[0].split(",") if x]
        return {g: [x * g // gpus[0] for x in base] for g in gpus}
    if len(groups) != len(gpus):
        raise SystemExit(f"{spec!r} has {len(groups)} '/'-separated lists but --gpus has {len(gpus)} entries")
    return {g: [int(x) for x in grp.split(",") if x] for g, grp in zip(gpus, groups)}


def parser() -> argparse.ArgumentParser:
    """The command line (the hidden flags are the child processes' protocol)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="SRc,stock")
    ap.add_argument("--gpus", default=None, help="GPU counts to sweep, e.g. 1,2 (default: every visible GPU, or 1)")
    ap.add_argument("--sessions", default="4,8,16,24,32,48,64",
                    help="N for the SRc cell, ascending; one list per --gpus entry separated by '/', or one list "
                         "(the first GPU count's, scaled for the others)")
    ap.add_argument("--stock-sessions", default="1,2,4,6,8", help="N for the stock cell (same form as --sessions)")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of audio per session, so per N (default 60)")
    ap.add_argument("--period", type=float, default=None,
                    help="seconds between a session's chunks, also the deadline (default 1 s: one Token2Wav chunk is "
                         "1 s of audio; 0.08 s for --model moshi: one frame; --code2wav-chunk / 12.5 s for --model "
                         "code2wav: one chunk of audio; shorter only for smoke runs)")
    ap.add_argument("--lanes", type=int, default=4, help="lanes of the SRc program, per GPU")
    ap.add_argument("--artifact", default=None,
                    help="SRc workers load this saved program (cf.load, --lanes lanes) instead of exporting and "
                         "optimizing; where no file is there yet, the first worker to build one saves it there")
    ap.add_argument("--full-lanes", type=int, default=None,
                    help="SRc: only this many lanes capture every catalog class, the others the steady (last) one; "
                         "a conversation's first chunks run on the full lanes (warmup(full_lanes=...))")
    ap.add_argument("--workers", type=int, default=0, help="serving threads per GPU (default: one per lane)")
    ap.add_argument("--procs-per-gpu", type=int, default=1,
                    help="SRc worker processes per GPU, each with --lanes lanes and an interpreter of its own; a "
                         "GPU's sessions are dealt round robin over them (default 1)")
    ap.add_argument("--share-weights", action="store_true",
                    help="--model moshi with --procs-per-gpu > 1: slot 0 of each GPU publishes its LM's parameters "
                         "(CUDA IPC) and the other slots map them once they are bitwise equal to their own "
                         "(cadence_fx.runtime.process_weights): one copy of the weights per GPU, not per process")
    ap.add_argument("--share-weights-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--share-weights-slots", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mps", action="store_true",
                    help="run the SRc workers under an MPS control daemon of this run's own (kernels of several "
                         "processes on one GPU at once); where none starts, the rows say so and run without")
    ap.add_argument("--branches", type=int, default=1,
                    help="SRc: streams per captured graph (CudaGraphBackend(branches=N): independent chains in "
                         "parallel; 1: one stream)")
    ap.add_argument("--blas-streams", type=int, default=None,
                    help="SRc with --branches: how many of each graph's streams may run matrix products (each keeps "
                         "a cuBLAS workspace per lane); default all")
    ap.add_argument("--cuda-connections", type=int, default=32,
                    help="CUDA_DEVICE_MAX_CONNECTIONS of the SRc workers (default 32, the most; 0: the driver's 8); under "
                         "--mps capped so a GPU's workers fit one pool of 96 (benchmarks/cadence_mps.client_connections)")
    ap.add_argument("--scripts", type=int, default=4)
    ap.add_argument("--journal", action="store_true",
                    help="optimize(..., journal=True): the undo journal in the graphs (for --pin; shared sessions never use it)")
    ap.add_argument("--pin", action="store_true",
                    help="pin each SRc session to a lane of its own while lanes last (no state copies per call; "
                         "the sessions beyond lanes - 1 share the rest)")
    ap.add_argument("--draw-replay", default="lock",
                    help="SRc: how graphs that draw are replayed, per row: 'lock' (the default: under the process-wide "
                         "draws' lock), 'lockless' (CADENCE_FX_LOCKLESS_DRAW_REPLAY's path: each lane's generator "
                         "state loaded directly), or 'lock,lockless': both rows at every N, in that order")
    ap.add_argument("--full-sweep", action="store_true", help="keep sweeping N after the first misses")
    ap.add_argument("--pack", action="store_true",
                    help="SRc: run the rows of a GPU count below the largest side by side on disjoint GPUs, only "
                         "rows of the same N (with --gpus 1,2: N on GPU 0 and N on GPU 1, two independent one-GPU "
                         "rows, a repeat; never a row beside a larger, overloaded one; each row still has its GPUs "
                         "to itself, the host is shared, as in the two-GPU rows)")
    ap.add_argument("--warm-seconds", type=float, default=None,
                    help="SRc: an untimed stream of this many seconds per worker, at the first N it will serve, "
                         "before its first measured row (default 10 with GPUs, 0 without; 0: none)")
    ap.add_argument("--join-live", action="store_true",
                    help="each session joins when its first chunk arrives (during the others' traffic)")
    ap.add_argument("--busy-window", type=float, default=1.0,
                    help="seconds of the profiler window for the GPU busy fraction, ending at the last arrival "
                         "(0: off)")
    ap.add_argument("--lead", type=float, default=2.0, help="seconds from sending a run to its t0")
    ap.add_argument("--row-slack", type=float, default=10.0,
                    help="an SRc row still running this many seconds past its last chunk's deadline is cut: the "
                         "chunks not served count as misses (abandoned) and its exactness is not judged")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="skip any N that would end later than this many seconds after the start (0: no limit)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="token2wav: float32 or float16 (where this checkout has the path); code2wav: float32 or "
                         "bfloat16; moshi: float32 only (it runs as released)")
    ap.add_argument("--solo-from", default=None,
                    help="take the solo stock digests from an earlier run's --json report instead of running them "
                         "again (the same model, dtype, sizes, chunks, scripts, torch and GPU model, else an error)")
    ap.add_argument("--model", default="token2wav", choices=("token2wav", "demo", "moshi", "code2wav"),
                    help="demo: the small demo decoder, for CPU smoke tests of the process layout; moshi: Moshi "
                         "full-duplex conversations (benchmarks/cadence_moshi.py); code2wav: Qwen3-Omni's Code2Wav "
                         "streaming a conversation's codes (benchmarks/cadence_code2wav.py)")
    ap.add_argument("--reduced", "--tiny", action="store_true",
                    help="reduced Token2Wav (or Moshi) sizes, Code2Wav's TINY (CPU smoke run)")
    ap.add_argument("--code2wav-chunk", type=int, default=25,
                    help="--model code2wav: code frames per chunk (default 25: 2 s of audio at 12.5 frames/s)")
    ap.add_argument("--code2wav-context", type=int, default=24,
                    help="--model code2wav: frames of context before each chunk (default 24: the contract needs "
                         "0 < context < chunk; benchmarks/cadence_code2wav.py says why)")
    ap.add_argument("--solo-stock", default="vendor", choices=("vendor", "eager"),
                    help="--model moshi: the solo runs through the vendor's process (CUDA graphs as shipped, the "
                         "server's warm-up and reset) or the eager stock code from the built state")
    ap.add_argument("--json", default=None, help="the report (rewritten after every row)")
    ap.add_argument("--rows", default=None, help="also append every row to this file (JSON lines)")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--solo", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return ap


def check_share_weights(args, visible: list[str]) -> None:
    """``--share-weights`` where it can work: Moshi (the other models' weights are small), several
    worker processes per GPU, and GPUs (CUDA IPC); anything else stops the run before it starts."""
    if not args.share_weights:
        return
    if args.model != "moshi":
        raise SystemExit("--share-weights: wired for --model moshi only (the other models' weights are small)")
    if args.procs_per_gpu < 2:
        raise SystemExit("--share-weights: needs --procs-per-gpu > 1 (one process already holds one copy)")
    if not visible:
        raise SystemExit("--share-weights: needs GPUs (the weights are shared through CUDA IPC)")


def main() -> None:
    args = parser().parse_args()
    draw_replay_modes(args.draw_replay)  # a mode that is not one stops the run before anything starts
    if args.model == "code2wav":
        code2wav.configure(args)  # before any process starts: the flags, transformers, the default period
    if args.period is None:
        args.period = 0.08 if args.model == "moshi" else 1.0
    if args.model == "moshi":
        if args.dtype != "float32":
            raise SystemExit("--model moshi runs as released (LM in bf16, Mimi in fp32): no --dtype")
        if getattr(args, "artifact", None):
            raise SystemExit("--model moshi: no --artifact (its three programs are exported and optimized)")
        if args.worker is not None:
            from benchmarks.cadence_moshi import run_worker as run_moshi_worker

            return run_moshi_worker(args)
    if args.model == "token2wav":
        dtype_hook(args.dtype)  # fail here, before any process starts, where there is no such path
    if args.worker is not None:
        return run_worker(args)
    if args.solo is not None:
        return run_solo_child(args)
    if args.child is not None:
        return run_stock_child(args)

    run = Run(args)
    if args.model == "moshi":  # the report's dtype field is Token2Wav's flag: say what Moshi ran as
        run.meta["moshi"] = dict(lm_dtype="bfloat16", mimi_dtype="float32", solo_stock=args.solo_stock,
                                 sizes="reduced" if args.reduced else "released")
    if args.model == "code2wav":
        run.meta["code2wav"] = code2wav.meta(args)
    gpus = sorted({int(x) for x in args.gpus.split(",")}) if args.gpus else [max(1, len(run.visible))]
    if run.visible and max(gpus) > len(run.visible):
        raise SystemExit(f"--gpus {args.gpus}: only {len(run.visible)} GPU(s) visible")
    cells = [c for c in args.cells.split(",") if c]
    if args.procs_per_gpu < 1:
        raise SystemExit(f"--procs-per-gpu {args.procs_per_gpu}: at least 1")
    if args.procs_per_gpu > 1 and args.pack:
        raise SystemExit("--procs-per-gpu > 1 shares each GPU among workers; --pack gives each row GPUs of its own")
    check_share_weights(args, run.visible)
    k = max(gpus)
    if args.solo_from:
        if args.model == "code2wav":
            code2wav.check_solo_from(args.solo_from, args)
        run.adopt_solo(args.solo_from)
        run.check_solo_device(gpu_name(run.visible))
    solo = None if args.solo_from else run.start_solo(k)
    # the SRc workers build beside the solo runs when SRc comes first; otherwise when its turn comes
    # (they hold their GPU's memory until the SRc cell is over)
    workers = run.start_workers(k) if cells[:1] == ["SRc"] else []
    try:
        if solo is not None:
            run.finish_solo(*solo)
        for cell in cells:
            if cell == "SRc":
                workers = workers or run.start_workers(k)
                try:
                    run.run_src(workers, gpus, per_gpu_lists(args.sessions, gpus))
                except RuntimeError as e:
                    run.add(dict(cell="SRc", name="SRc", gpus=None, n_sessions=None, error=str(e)[-3000:]))
                for w in workers:
                    w.close()
                run.stop_mps()
            elif cell == "stock":
                # each row starts its own stock processes (StockRow): none sit idle beside the SRc rows
                run.run_stock(gpus, per_gpu_lists(args.stock_sessions, gpus))
            else:
                raise SystemExit(f"unknown cell {cell!r} (SRc, stock)")
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        run.stop_mps()
    report = run.report()
    print(table(run.rows))
    print("limits: " + json.dumps(report["limits"]))
    if args.json:
        harness.write_json(args.json, report)


if __name__ == "__main__":
    main()
