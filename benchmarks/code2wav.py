"""Qwen3-Omni's Code2Wav (transformers 5.24 ``Qwen3OmniMoeCode2Wav``) streamed by ``chunked_decode``: one
stream per cell, every cell in a fresh process.

    python benchmarks/code2wav.py --cells stock,stockb,buckets,exact,cadence --chunks 20 --json .out/code2wav.json
    python benchmarks/code2wav.py --cells stock_bf16,buckets_bf16,exact_bf16,cadence_bf16 --json .out/code2wav-bf16.json
    python benchmarks/code2wav.py --tiny --chunks 12 --cells stock,cadence --json /tmp/c2w.json   # CPU smoke

Released sizes (:data:`cadence_fx.adapters.code2wav.RELEASED`: 8 transformer layers of 1024, 16 codebooks,
1,920 samples per code frame), random weights from seed 0 built on the device, a stream of ``--chunks``
chunks of ``--chunk-size`` (300) random code frames with ``--left-context`` (25) frames of context, fp32
(cells ``NAME``) or bfloat16 (``NAME_bf16``, gated against ``stock_bf16``). Cells:

- ``stock``    ``model.chunked_decode(codes, chunk_size, left_context_size)`` as transformers runs it, eager.
               Per-chunk latency is each chunk's ``model(...)`` call (forward hooks, synchronised).
- ``stockb``   ``stock`` again in a process of its own: is the stock stream reproducible across processes?
- ``buckets``  the padded-bucket CUDA-graph wrapper serving engines ship (``benchmarks/code2wav_buckets.py``:
               vLLM-Omni's buckets by default, ``--buckets``; every chunk after the first padded 325 -> 400
               frames), installed as the model's forward, the stock ``chunked_decode`` loop around it.
- ``exact``    the same wrapper with one graph per length the stream has (300 and 325 frames), no padding: what
               SGLang-Omni's runner and vLLM-Omni's later capture sizes do. CUDA only, as ``buckets`` (both
               skipped without a GPU).
- ``cadence``  ``cadence_fx.optimize(export_catalog(step, contract, example), contract)`` of the adapter's step
               (:mod:`cadence_fx.adapters.code2wav`), replayed (``replay="auto"``: CUDA graphs on a GPU,
               eager on the CPU; ``--cpu-replay fake`` runs the replay engine on the CPU), warmed up first.
- ``cadenceb`` ``cadence`` replayed by ``CudaGraphBackend(branches=3, blas_streams=2)``: each graph's independent
               chains on side streams (CUDA only).

Every row: per-chunk ms (p50/p95/p99), the stream's wall time, peak MiB (``torch.cuda.max_memory_allocated``
from the moment the cell is built: warm-up or capture included, build and export excluded), SHA-256 of
the concatenated wav and a digest per chunk. The gate (``benchmarks/harness.py``) credits a speedup only
to a cell whose SHA-256 equals its stock cell's (another process). The buckets, exact and cadence cells
also decode the same codes with the stock ``chunked_decode`` in their own process after the timed stream
and compare chunk by chunk (``torch.equal``, max abs difference): ``inprocess``. One more chunk is
profiled after the stream (kernels, host launches, GPU busy ms per chunk).

The GPU machine may lack transformers: it is imported only once a cell runs, with a message naming the
wheels to carry when it is missing (``scripts/gpu.sh code2wav`` installs what ``.whl/`` holds).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from cadence_fx.determinism import describe_envelope, pin_envelope, sha256_tensors  # noqa: E402

KINDS = ("stock", "stockb", "buckets", "exact", "cadence", "cadenceb")
# cadenceb: cadence with branch streams inside its graphs (the candidate for the default, issue 31 item 6)
CUDA_ONLY = ("buckets", "exact", "cadenceb")
DTYPES = {"": torch.float32, "_bf16": torch.bfloat16}
CHUNK_DIGEST = 16  # hex digits of each chunk's digest kept in a row
NEEDS = ("transformers 5.24 (Qwen3OmniMoeCode2Wav) and what it imports: huggingface_hub, tokenizers, safetensors, "
         "regex, PyYAML, tqdm, packaging, numpy, filelock, fsspec, httpx2, httpcore2, anyio, h11, idna, truststore, "
         "typing_extensions")


def require_transformers() -> str:
    """transformers' version, or exit with what to install (the GPU machine has no package index)."""
    try:
        transformers = importlib.import_module("transformers")
        importlib.import_module("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
    except ImportError as exc:
        raise SystemExit(f"benchmarks/code2wav.py: cannot import Qwen3-Omni's Code2Wav ({exc}).\n"
                         f"It needs {NEEDS}. On the GPU machine put their wheels in .whl/ (scripts/gpu.sh installs "
                         f"them into /tmp/site) or on PYTHONPATH.") from None
    return str(transformers.__version__)


def parse_cell(name: str) -> tuple[str, torch.dtype, str]:
    """``(kind, dtype, baseline cell)`` of a cell name such as ``cadence_bf16``."""
    suffix = "_bf16" if name.endswith("_bf16") else ""
    kind = name[: len(name) - len(suffix)]
    if kind not in KINDS:
        raise SystemExit(f"unknown cell {name!r}: one of {', '.join(KINDS)}, each optionally with _bf16")
    return kind, DTYPES[suffix], "stock" + suffix


# --------------------------------------------------------------------------- the stream
def windows(chunks: int, chunk: int, left: int) -> list[tuple[int, int]]:
    """``(context frames, window frames)`` of each chunk of ``chunked_decode`` over ``chunks * chunk`` frames."""
    out = []
    for k in range(chunks):
        start = k * chunk
        ctx = left if start - left > 0 else start  # chunked_decode's rule
        out.append((ctx, ctx + chunk))
    return out


@contextlib.contextmanager
def chunk_clock(model: Any) -> Iterator[dict[str, list]]:
    """Forward hooks on ``model``: each call's milliseconds (synchronised on both sides) and its output,
    copied to the host after the clock stops."""
    rec: dict[str, list] = {"ms": [], "out": []}
    t0 = [0.0]

    def before(_module: Any, _args: Any) -> None:
        harness.sync()
        t0[0] = time.perf_counter()

    def after(_module: Any, _args: Any, out: torch.Tensor) -> None:
        harness.sync()
        rec["ms"].append((time.perf_counter() - t0[0]) * 1e3)
        rec["out"].append(out.detach().to("cpu", copy=True))

    hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        yield rec
    finally:
        for h in hooks:
            h.remove()


def stock_stream(model: Any, codes: torch.Tensor, args: argparse.Namespace) -> tuple[list[torch.Tensor], dict]:
    """``model.chunked_decode`` over ``codes``: each chunk's kept samples (host), the per-chunk ms, the wall
    time and whether the pieces concatenate to what ``chunked_decode`` returned."""
    up = int(model.total_upsample)
    with torch.no_grad(), chunk_clock(model) as rec:
        wav, total_ms = harness.timed(model.chunked_decode, codes, args.chunk_size, args.left_context)
    ctxs = [c for c, _w in windows(len(rec["out"]), args.chunk_size, args.left_context)]
    pieces = [o[..., c * up:] for o, c in zip(rec["out"], ctxs)]
    consistent = torch.equal(torch.cat(pieces, -1), wav.to("cpu"))
    return pieces, {"ms": rec["ms"], "total_ms": total_ms, "pieces_equal_return": consistent}


def compare(pieces: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    """Chunk by chunk against the stock pieces of the same process: ``torch.equal``, the largest absolute
    difference over the samples both have, and lengths."""
    equal = [a.shape == b.shape and torch.equal(a, b) for a, b in zip(pieces, ref)]
    diffs = []
    for a, b in zip(pieces, ref):
        n = min(a.shape[-1], b.shape[-1])
        diffs.append(float((a[..., :n].float() - b[..., :n].float()).abs().max()) if n else 0.0)
    return {"chunks_equal": equal, "all_equal": all(equal) and len(pieces) == len(ref),
            "max_abs_diff": max(diffs, default=0.0), "chunk_max_abs_diff": diffs,
            "samples": sum(p.shape[-1] for p in pieces), "stock_samples": sum(p.shape[-1] for p in ref),
            "stock_sha256": sha256_tensors(ref)}


# --------------------------------------------------------------------------- cells
def build(args: argparse.Namespace, dtype: torch.dtype) -> tuple[Any, Any, torch.Tensor, str]:
    """(adapter module, model, the stream's codes, device), the envelope pinned."""
    require_transformers()
    from cadence_fx.adapters import code2wav as c2w

    pin_envelope()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = c2w.build(c2w.config(c2w.TINY if args.tiny else None), device=device, dtype=dtype, seed=0)
    codes = c2w.stream_codes(model, args.chunks, args.chunk_size)
    harness.sync()
    print(f"[build] {time.perf_counter() - t0:.1f} s on {device}, {dtype}", file=sys.stderr, flush=True)
    return c2w, model, codes, device


def ready(device: str) -> None:
    """The cell is built: drop garbage and cached blocks, start counting the peak."""
    gc.collect()
    if device == "cuda":
        harness.release_library_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def row(name: str, baseline: str, dtype: torch.dtype, ms: list[float], pieces: list[torch.Tensor],
        peak_mib: float | None, **extra: Any) -> dict:
    """One cell's row: latencies, digests, the peak (read right after the timed stream)."""
    return dict(name=name, baseline=baseline, dtype=str(dtype).replace("torch.", ""), p50_ms=harness.percentile(ms, 50),
                p95_ms=harness.percentile(ms, 95), p99_ms=harness.percentile(ms, 99), ms=ms,
                sha256=sha256_tensors(pieces), chunk_sha=[sha256_tensors(p)[:CHUNK_DIGEST] for p in pieces],
                samples=sum(p.shape[-1] for p in pieces), peak_mib=peak_mib, **extra)


def context(device: str) -> dict[str, Any]:
    out: dict[str, Any] = dict(device=device, torch=torch.__version__, transformers=require_transformers(),
                               envelope=describe_envelope())
    out["gpu"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return out


def profile(fn: Callable[[], Any]) -> dict[str, float]:
    """Kernels, host launches and GPU busy ms of one more chunk (nan on the CPU)."""
    p = harness.profile_calls(fn)
    return {"kernels_per_chunk": p["kernels"], "launches_per_chunk": p["launches"], "busy_ms": p["busy_ms"]}


def run_stock(args: argparse.Namespace, name: str) -> dict:
    _kind, dtype, baseline = parse_cell(name)
    _c2w, model, codes, device = build(args, dtype)
    ready(device)
    warm = min(2, args.chunks) * args.chunk_size
    with torch.no_grad():
        model.chunked_decode(codes[..., :warm], args.chunk_size, args.left_context)  # both window lengths
    pieces, t = stock_stream(model, codes, args)
    r = row(name, baseline, dtype, t.pop("ms"), pieces, harness.peak_mib(), warmup_s=0.0, **t, **context(device))
    last = codes[..., -(args.chunk_size + args.left_context):]
    with torch.no_grad():
        r.update(profile(lambda: model(last)))
    return r


def run_buckets(args: argparse.Namespace, name: str) -> dict:
    kind, dtype, baseline = parse_cell(name)
    if not torch.cuda.is_available():
        raise SystemExit(f"cell {name}: CUDA graphs need a GPU")
    from benchmarks.code2wav_buckets import BucketGraphs

    _c2w, model, codes, device = build(args, dtype)
    lengths = [w for _c, w in windows(args.chunks, args.chunk_size, args.left_context)]
    padded = kind == "buckets"
    graphs = BucketGraphs(model, args.buckets if padded else sorted(set(lengths)), pad=padded, cut=args.bucket_cut)
    ready(device)
    cap = graphs.capture(None if args.capture_all else lengths)
    with graphs.installed():
        pieces, t = stock_stream(model, codes, args)
        peak = harness.peak_mib()
        padding, calls = graphs.padding(), list(graphs.calls)  # the stream's calls, not the profiled one
        last = codes[..., -(args.chunk_size + args.left_context):]
        with torch.no_grad():
            prof = profile(lambda: model(last))
    r = row(name, baseline, dtype, t.pop("ms"), pieces, peak, warmup_s=cap["seconds"], capture=cap, **t, **prof,
            buckets=padding, bucket_calls=calls, bucket_sizes=graphs.sizes, **context(device))
    ref, _t = stock_stream(model, codes, args)
    r["inprocess"] = compare(pieces, ref)
    return r


def run_cadence(args: argparse.Namespace, name: str) -> dict:
    _kind, dtype, baseline = parse_cell(name)
    import cadence_fx as cf

    c2w, model, codes, device = build(args, dtype)
    step, contract, example = c2w.bind(model, args.chunk_size, args.left_context)
    t0 = time.perf_counter()
    eps = cf.export_catalog(step, contract, example)
    export_s = time.perf_counter() - t0
    replay: Any = "auto"
    if _kind == "cadenceb":  # the plan Token2Wav's float16 cell measured best (SRchb2)
        from cadence_fx.runtime.backends import CudaGraphBackend

        replay = CudaGraphBackend(branches=3, blas_streams=2)
    elif device == "cpu" and args.cpu_replay == "fake":
        from cadence_fx.testing.fake_backend import FakeBackend

        replay = FakeBackend()
    warnings = harness.library_warnings()
    t0 = time.perf_counter()
    prog = cf.optimize(eps, contract, replay=replay)
    optimize_s = time.perf_counter() - t0
    chunks = [codes[..., k * args.chunk_size:(k + 1) * args.chunk_size].contiguous() for k in range(args.chunks)]
    ready(device)
    warm = prog.warmup(example["ctx_codes"], chunks[0])
    ms, pieces = [], []
    ctx = example["ctx_codes"]
    t0 = time.perf_counter()
    with torch.no_grad():
        for new in chunks:
            (wav, ctx), t = harness.timed(prog, ctx, new)
            ms.append(t)
            pieces.append(wav.detach().to("cpu", copy=True))  # before the next call overwrites it
    total_ms = (time.perf_counter() - t0) * 1e3  # with the host copies, as the stock cell's wall has them
    peak = harness.peak_mib()
    counters = prog.counters()
    prof = profile(lambda: prog(ctx, chunks[-1]))  # one more chunk of the steady class
    traffic = [{"class": c["class"], "regions": c["regions"], "left_stock": [str(f) for f in c["left_stock"]]}
               for c in cf.state_traffic(prog)]
    r = row(name, baseline, dtype, ms, pieces, peak, total_ms=total_ms, warmup_s=warm["seconds"], export_s=export_s,
            optimize_s=optimize_s, counters=counters, classes=cf.call_classes(contract),
            replay=replay if isinstance(replay, str) else type(replay).__name__,
            memory={k: v / 2**20 for k, v in prog.memory_census().items()}, traffic=traffic,
            library_warnings=warnings, **prof, **context(device))
    ref, _t = stock_stream(model, codes, args)
    r["inprocess"] = compare(pieces, ref)
    r["notes"] = f"replays {counters['replays']}, eager {counters['eager']}"
    return r


CELL_RUNNERS = {"stock": run_stock, "stockb": run_stock, "buckets": run_buckets, "exact": run_buckets,
                "cadence": run_cadence, "cadenceb": run_cadence}


# --------------------------------------------------------------------------- driver
def chunk_matches(r: dict, base: dict | None) -> int | None:
    """Chunks whose digest equals the same chunk's of the stock cell (another process)."""
    if not base or "chunk_sha" not in base:
        return None
    return sum(a == b for a, b in zip(r["chunk_sha"], base["chunk_sha"]))


def report(cells: list[dict], skipped: list[dict], args: argparse.Namespace) -> dict:
    by = {r["name"]: r for r in cells if "error" not in r}
    for r in cells:
        if "error" not in r:
            r["chunks_match_stock"] = chunk_matches(r, by.get(r.get("baseline", "stock")))
    first = next(iter(by.values()), {})
    print(f"Code2Wav {'tiny' if args.tiny else 'released'} sizes, {args.chunks} chunks of {args.chunk_size} frames "
          f"(+{args.left_context} context), {first.get('gpu', '?')}, torch {first.get('torch', torch.__version__)}, "
          f"transformers {first.get('transformers', '?')}, {date.today()}")
    head = (f"{'cell':<14}{'p50 ms':>9}{'p99 ms':>9}{'stream ms':>11}{'peak MiB':>10}{'warm s':>8}  {'sha256':<13}"
            f"{'exact':>6}{'chunks =':>9}{'max|d|':>10}{'speedup':>9}  notes")
    print(head)
    print("-" * len(head))
    for r in cells:
        if "error" in r:
            print(f"{r['name']:<14}failed: {(r['error'].strip().splitlines() or ['?'])[-1][:100]}")
            continue
        ip = r.get("inprocess") or {}
        eq = f"{sum(ip['chunks_equal'])}/{len(ip['chunks_equal'])}" if ip else (
            f"{r['chunks_match_stock']}/{len(r['chunk_sha'])}" if r.get("chunks_match_stock") is not None else "-")
        notes = r.get("notes", "")
        if r.get("buckets"):
            b = r["buckets"]
            notes = (f"padded {b['padded_frames']}/{b['real_frames'] + b['padded_frames']} decoded frames "
                     f"({100 * b['padded_share_of_decoded']:.1f} %), paths {b['paths']}")
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else ("-" if r.get("bitexact") else "NOT EXACT")
        print(f"{r['name']:<14}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r.get('total_ms', sum(r['ms'])):>11.1f}"
              f"{harness.fmt_number(r.get('peak_mib'), '.0f'):>10}{r.get('warmup_s', 0.0):>8.2f}"
              f"  {r['sha256'][:12]:<13}"
              f"{str(r['bitexact']):>6}{eq:>9}{ip.get('max_abs_diff', float('nan')):>10.3g}{sp:>9}  {notes}")
    for s in skipped:
        print(f"{s['name']:<14}skipped: {s['reason']}")
    for r in cells:
        for line in (r.get("library_warnings") or [])[:3]:
            print(f"{r['name']:<14}cadence_fx: {line[:300]}")
    doc = dict(model="Qwen3OmniMoeCode2Wav", sizes="tiny" if args.tiny else "released", date=str(date.today()),
               gpu=first.get("gpu"), torch=first.get("torch"), transformers=first.get("transformers"),
               envelope=first.get("envelope"), chunks=args.chunks, chunk_size=args.chunk_size,
               left_context_size=args.left_context, cells=cells, skipped=skipped,
               summary=harness.summarize(cells, baseline="stock"),
               exact={r["name"]: r.get("bitexact") for r in cells if "error" not in r})
    if args.json:
        harness.write_json(args.json, doc)
    return doc


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=20, help="chunks per stream")
    ap.add_argument("--chunk-size", type=int, default=None, help="code frames per chunk (300; --tiny: 10)")
    ap.add_argument("--left-context", type=int, default=None, help="context frames (25; --tiny: 3)")
    ap.add_argument("--tiny", action="store_true", help="the adapter's TINY sizes (a CPU smoke run)")
    ap.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="bucket lengths of the buckets cell (default vLLM-Omni's 64,100,150,200,250,300,400,500)")
    ap.add_argument("--capture-all", action="store_true",
                    help="buckets: capture every bucket (the footprint vLLM-Omni pays), not only those reached")
    ap.add_argument("--bucket-cut", choices=("model", "frames"), default="model",
                    help="buckets: cut a padded output at the model's own length (model; vLLM-Omni's later wrappers) "
                         "or at frames x upsampling (frames; its first wrapper: a longer stream than eager's)")
    ap.add_argument("--cpu-replay", choices=("eager", "fake"), default="eager",
                    help="cadence on the CPU: no replay, or the replay engine over cadence_fx's FakeBackend")
    harness.add_flags(ap, cells="stock,buckets,exact,cadence", blocks=1)
    args = ap.parse_args(argv)
    args.chunk_size = args.chunk_size or (10 if args.tiny else 300)
    args.left_context = args.left_context or (3 if args.tiny else 25)
    if args.buckets is None:
        from benchmarks.code2wav_buckets import VLLM_OMNI_BUCKETS

        args.buckets = list(VLLM_OMNI_BUCKETS) if not args.tiny else [8, 16]  # tiny: 10 and 13 frames padded to 16
    if args.one:
        kind, _dtype, _base = parse_cell(args.one)
        harness.write_cell(args.out, CELL_RUNNERS[kind](args, args.one))
        return None
    if args.merge is not None:
        return report(harness.gate(harness.read_rows(args.merge), baseline="stock"), [], args)
    require_transformers()  # before any process starts: a clear message, once
    lanes, skipped = [], []
    for lane in harness.lanes_of(args.cells, args.lanes):
        keep = []
        for c in lane:
            kind, _d, _b = parse_cell(c)
            if kind in CUDA_ONLY and not torch.cuda.is_available():
                skipped.append({"name": c, "reason": "needs CUDA (CUDA graphs)"})
            else:
                keep.append(c)
        lanes.append(keep)
    common = ["--chunks", str(args.chunks), "--chunk-size", str(args.chunk_size), "--left-context",
              str(args.left_context), "--buckets", ",".join(map(str, args.buckets)), "--bucket-cut",
              args.bucket_cut, "--cpu-replay", args.cpu_replay] + (["--tiny"] if args.tiny else []) + (
        ["--capture-all"] if args.capture_all else [])
    cells = harness.gate(harness.run_cells(__file__, lanes, common, rows_path=args.rows), baseline="stock")
    return report(cells, skipped, args)


if __name__ == "__main__":
    main()
