"""Moshi through sessions on lanes against the stock streams, frame by frame (a diagnostic).

    python benchmarks/moshi_sessions.py --frames 40 --lanes 4 --scripts 2 --json .out/moshi-sessions.json

The conversations-per-GPU benchmark (``benchmarks/cadence.py --model moshi``) gates each session with one
SHA-256 over its whole stream, against its script's solo run in the vendor's process. When a gate
fails, this says where: one process builds the stock stack twice (the eager stock code from the built
state, ``B0``; the vendor's process, warm-up then reset, ``vendor``) and the optimized programs once
(``optimized_bench``: ``--lanes`` lanes, captured), and streams every script through

- ``eager`` and ``vendor``: the two stock references;
- ``default``: the programs' own calls (lane 0, the default session: what ``benchmarks/moshi.py``'s SR is);
- ``session``: one session per script, alone (a lane after the first);
- ``concurrent``: ``--concurrent`` sessions per script at once, one thread (and stream) each, as the
  cadence worker serves them.

For each stream against each reference: the first frame whose tokens differ and the first whose PCM
differs (``None``: equal throughout). Also the wall time of the concurrent streams (frames back to back,
no cadence): frames per second with N sessions at once, for N in ``--throughput`` (where the cadence
rows found the serving collapse).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cadence_model import child_setup, device_name  # noqa: E402
from benchmarks.cadence_moshi import StockFrame, _build, optimized_bench  # noqa: E402


def _frames(step, conv_call, audio, state0) -> list[tuple[bytes, bytes | None]]:
    """Every frame's (tokens, PCM) bytes of one stream through ``conv_call(x, state) -> (bytes, state)``."""
    out, st = [], dict(state0)
    for x in audio:
        with torch.no_grad():
            b, st = conv_call(x, st)
        out.append(b.cpu().numpy().tobytes())
    return out


def _stock_stream(frame: StockFrame, audio, script: int) -> list[bytes]:
    torch.manual_seed(script)
    return _frames(frame, frame.driver_call, audio, {"frame": torch.tensor(0)})


def _first_diff(a: list[bytes], b: list[bytes], tokens_len: int) -> dict:
    tok = next((k for k, (x, y) in enumerate(zip(a, b)) if x[:tokens_len] != y[:tokens_len]), None)
    pcm = next((k for k, (x, y) in enumerate(zip(a, b)) if x[tokens_len:] != y[tokens_len:]), None)
    return {"tokens": tok, "pcm": pcm, "equal": a == b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--scripts", type=int, default=2)
    ap.add_argument("--concurrent", type=int, default=2, help="sessions per script at once")
    ap.add_argument("--throughput", default="1,2,4", help="N sessions at once for the frames-per-second rows")
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--branches", type=int, default=1)
    ap.add_argument("--journal", action="store_true", help="optimize(..., journal=True): the undo journal")
    ap.add_argument("--pin", action="store_true", help="pin every session to a lane of its own (no state copies)")
    ap.add_argument("--blas-streams", type=int, default=None)
    ap.add_argument("--refs", default="eager,vendor", help="stock references to stream (eager is ~5x slower)")
    ap.add_argument("--repeat", type=int, default=1, help="times the concurrent streams are run (a race shows as variation)")
    ap.add_argument("--lane-sweep", type=int, default=0,
                    help="also stream script 0 for this many frames once per lane of each program, the program "
                         "pinned to that lane (the others held): which lanes' graphs give other bytes")
    ap.add_argument("--profile", default="", help="N sessions at once (comma list) streamed under torch.profiler: "
                    "which runtime calls block, busy, kernels at once")
    ap.add_argument("--profile-frames", type=int, default=12, help="frames per session under the profiler")
    ap.add_argument("--trace", default=None, help="a chrome trace of the first --profile run (gzip)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = child_setup()
    from cadence_fx.adapters.moshi import user_audio

    report: dict = {"device": device_name(device), "torch": torch.__version__, "args": vars(args), "streams": {}}
    t0 = time.perf_counter()
    mo, up, _cfg, steps, _ = _build(args, device)
    frame_size = steps.encode.module.frame_size
    audio = {s: user_audio(args.frames, frame_size=frame_size, seed=10000 + s, device=device) for s in range(args.scripts)}
    refs = [r for r in args.refs.split(",") if r]
    streams: dict[str, dict[int, list[bytes]]] = {}
    for i, ref in enumerate(refs):  # a fresh stack per reference, as a process of its own would have
        if i:
            mo, up, _cfg, steps, _ = _build(args, device)
        stock = StockFrame(mo, up, steps, device, ref)
        streams[ref] = {s: _stock_stream(stock, audio[s], s) for s in range(args.scripts)}
        del stock, steps
    torch.cuda.empty_cache() if device == "cuda" else None
    report["stock_s"] = time.perf_counter() - t0
    print(f"stock streams in {report['stock_s']:.1f} s", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    bench, conv, facts = optimized_bench(args, device)
    report["optimize_s"] = time.perf_counter() - t0
    state0 = bench.state0
    from cadence_fx.adapters.moshi import step_frame
    from benchmarks.cadence_moshi import frame_bytes

    def default_call(x, st):
        k = int(st["frame"])
        cur = {n: dict(st[n]) for n in ("encode", "lm", "decode")}
        f = step_frame(bench.steps, conv.progs, cur, x, k)
        return frame_bytes(f.tokens, f.pcm), {"frame": k + 1, **cur}

    streams["default"], streams["session"], streams["concurrent"] = {}, {}, {}
    for s in range(args.scripts):
        torch.manual_seed(s)
        streams["default"][s] = _frames(None, default_call, audio[s], state0)
        sess = conv.session(f"alone-{s}", seed=s, pin=args.pin)
        streams["session"][s] = _frames(None, sess, audio[s], state0)
        sess.close()

    def run_many(n_per_script: int, scripts: int, frames: int | None = None) -> tuple[dict, float]:
        got: dict[str, list[bytes]] = {}
        sessions = {f"{s}.{i}": conv.session(f"c{n_per_script}-{s}.{i}", seed=s, pin=args.pin)
                    for s in range(scripts) for i in range(n_per_script)}

        def one(name: str) -> None:
            s = int(name.split(".")[0])
            with torch.cuda.stream(torch.cuda.Stream()) if device == "cuda" else contextlib.nullcontext():
                got[name] = _frames(None, sessions[name], audio[s][:frames], state0)

        threads = [threading.Thread(target=one, args=(n,)) for n in sessions]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        for c in sessions.values():
            c.close()
        return got, wall

    if args.lane_sweep:
        report["lane_sweep"] = lane_sweep(conv, state0, audio[0][:args.lane_sweep],
                                          [f[:] for f in streams[refs[0]][0][:args.lane_sweep]], device)
        print("lane sweep:", report["lane_sweep"], file=sys.stderr, flush=True)
    for r in range(args.repeat):
        got, _ = run_many(args.concurrent, args.scripts)
        streams["concurrent" if r == 0 else f"concurrent{r}"] = dict(got)
    report["throughput"] = {}
    for n in [int(v) for v in args.throughput.split(",") if v]:
        _got, wall = run_many(n, 1)
        report["throughput"][n] = {"wall_s": wall, "frames_per_s": n * args.frames / wall,
                                   **{f"exact_vs_{r}": all(v == streams[r][0] for v in _got.values()) for r in refs}}
        print(f"N={n}: {n * args.frames / wall:.1f} frames/s ({wall:.2f} s)", file=sys.stderr, flush=True)
    report["profile"] = {}
    for i, n in enumerate(int(v) for v in args.profile.split(",") if v):
        from torch.profiler import ProfilerActivity, profile
        from benchmarks.profile_summary import print_summary, summarize
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            _got, wall = run_many(n, 1, args.profile_frames)
        summary = summarize(prof, wall)
        summary["frames_per_s"] = n * args.profile_frames / wall
        summary["cuda_device_max_connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        report["profile"][n] = summary
        print(f"N={n} under the profiler: {summary['frames_per_s']:.1f} frames/s", file=sys.stderr)
        print_summary(summary, sys.stderr)
        if args.trace and i == 0:
            prof.export_chrome_trace(args.trace)
    tokens_len = len(streams[refs[0]][0][0])  # frame 0 has no PCM (the LM's delays)
    for kind, per in list(streams.items()):
        for name, frames in per.items():
            s = int(str(name).split(".")[0])
            report["streams"][f"{kind}:{name}"] = {ref: _first_diff(frames, streams[ref][s], tokens_len)
                                                  for ref in refs}
    for k, v in report["streams"].items():
        print(k, v, file=sys.stderr, flush=True)
    report["counters"] = conv.counters()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


def lane_sweep(conv, state0, audio, ref: list[bytes], device: str) -> dict:
    """For each program and each of its lanes: script 0 streamed with that program held to that lane (its
    other lanes taken by this thread for the stream), the others free; the first frame that differs from
    ``ref`` per lane (``None``: equal)."""
    out: dict = {}
    for name, prog in conv.progs.items():
        pool = prog.lanes
        row = {}
        for k in range(1, len(pool.lanes)):  # sessions take lane 0 (the default session's) only when no other is free
            with contextlib.ExitStack() as held:
                for j in range(len(pool.lanes)):
                    if j != k:
                        held.enter_context(pool.take(j))
                sess = conv.session(f"sweep-{name}-{k}", seed=0)
                got = _frames(None, sess, audio, state0)
                sess.close()
            row[k] = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        out[name] = row
    return out


if __name__ == "__main__":
    main()
