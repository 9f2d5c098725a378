"""Token2Wav (MiniCPM-o 4.5 / Step-Audio2 streaming decoder): the factorial benchmark.

    python benchmarks/token2wav.py --blocks 4 --chunks 24 --json docs/results/token2wav-h200.json

Released dimensions, random weights, fp32, prompt of 151 tokens, 28-token chunks, the 0.1.2 driver
(flow chunk + stock trim + stochastic HiFT). Cells:

- ``B0``         the stock eager code as shipped (``flow.inference_chunk`` + trim + HiFT) with the stock
                 driver's own state handling (``Token2WavStep.driver_call``: only the vocoder caches are
                 copied, as ``Token2wav.stream`` does; rows recorded before 2026-11-30's last commits used
                 ``stock_call``, which clones every output);
- ``vendor``     the same with the vendor CUDA-graph branch enabled as shipped (buckets 30/48/96);
- ``vendor_live`` the vendor branch re-bucketed to the live estimator call (its padded graph captured
  for the chunk size the stream uses, padded to the largest history);
- ``compile``    the stock code with the estimator under ``torch.compile(mode="reduce-overhead")``;
- ``S``          state rule only (no replay);
- ``R``/``Rc``   replay at the step / chunk clock without the state rule;
- ``SR``/``SRc`` both rules; at the chunk clock (``Rc``, ``SRc``) the CFM loop is keyed and replayed
  once per chunk, captured as one graph per solver step (the adapter's default);
- ``SRc1``       ``SRc`` with the whole CFM loop captured as one graph (``step_segments=False``);
- ``SRcnt``      ``SRc`` without the default program's undo log (``transactional=False``): beside ``SRc``,
                 what keeping the state through a call that raises costs per chunk;
- ``B0h``        the stock driver's float16 switch (``Token2wav(float16=True)``: ``flow.half()``, the flow call
                 under float16 autocast, HiFT in float32): the baseline of the float16 path;
- ``SRch``       ``SRc`` of the same float16 step (its autocast blocks lowered to explicit casts by the
                 ``inline_autocast`` pass), gated against ``B0h``.
- ``SRcb``/``SRchb``  ``SRc``/``SRch`` captured with ``CudaGraphBackend(branches=3)``: each graph's independent
                 chains (projections, rotary embeddings, parallel residual blocks) on up to three streams of
                 the one graph (``cadence_fx.analysis.branch_plan``); the same kernels, gated against ``B0``/``B0h``.
- ``SRcs``/``SRchs``  ``SRc``/``SRch`` with one stream per graph (``CudaGraphBackend()``): since session 26
                 ``replay="auto"`` gives a one-lane program three branch streams (``SRc`` is then ``SRcb``'s
                 setting); these are the single-stream cells.
- ``SRchb2``     ``SRchb`` with the matrix products on two of the three streams (``blas_streams=2``): the
                 process keeps one cuBLAS workspace fewer.
- ``B0n``        the 1.0.7 driver as it ships (``minicpmo-utils-1.0.7``): the flow step with the 1.0.7 trims
                 (``Token2WavStep(flow, None, cfg, driver="1.0.7")``, ``driver_call``: no extra copies), then
                 its own ``BoundedVocoder`` on the chunk's mel, eagerly (``bounded_vocoder_stream``; a causal
                 HiFT with seeded random weights, ``build_causal_vocoder``); the PCM it returns per chunk is
                 hashed. The baseline of the 1.0.7 path;
- ``SRcn``       the same stream with the flow step as ``SRc`` (state rule, chunk clock, one graph per solver
                 step; the 1.0.7 conformer cache passes through unmanaged) and the ``BoundedVocoder``'s
                 stateless ``decode`` replayed (``replay_bounded_vocoder``: exported per shape seen on six
                 example mel chunks, optimized, captured before the blocks; a call outside that catalog runs
                 the stock ``decode``, counted in the notes); its host bookkeeping stays stock. Gated against
                 ``B0n``. The vocoder's state is its cache dict (offsets on the host, histories on the
                 device): each block starts from a copy of the reset dict, and the restore block's snapshot
                 deep-copies it with the flow state (the dict the 1.0.7 driver restores on a turn reset).
                 The decode's export, optimize and capture run after the peak counter starts (with the warm-up;
                 small next to the flow's); rows carry ``vocoder`` (replay seconds, catalog size, the signatures
                 that ran stock).

Process layout: **every cell runs in a fresh process**. Each builds the step from the benchmark seed
and runs the prompt (the initial state); optimized cells then export the catalog (one static-shape
program per class) and ``cadence_fx.optimize`` it, and the stock module's buffers the optimized
program does not use (its workspaces) are freed, as a deployment drops the stock module after export.
Each cell streams ``--blocks`` blocks of ``--chunks`` chunks from the same initial state, each block
with its own token stream and seed; the last block restores every cache from a snapshot mid-stream (a
turn boundary). A cell whose PCM bytes differ from B0's in the same block is NOT EXACT and gets no
speedup. ``--lanes 2`` runs two queues of cells side by side, one GPU each (``CUDA_VISIBLE_DEVICES``);
every lane runs its own B0 and each cell is gated against the B0 of its own lane (the report also
checks that the lanes' B0 bytes agree).

Peak is ``torch.cuda.max_memory_allocated`` from the moment the cell is ready to serve (weights,
state, workspaces, graph pools, static buffers, warm-up included; building or loading the model and
``optimize`` excluded, for every cell alike), cumulative over the blocks. The benchmark itself keeps
the initial state and the snapshot on the host, so they count for no cell.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from cadence_fx.determinism import describe_envelope, pin_envelope, sha256_tensors  # noqa: E402
from cadence_fx.runtime.state import state_to  # noqa: E402

STOCK_CELLS = ("B0", "B0h", "B0n", "vendor", "vendor_live", "compile")
# the float16 path (``Token2wav(float16=True)``: the flow in half under autocast): its cells end in "h"
# and are gated against B0h, the stock code with the switch on
HALF_BASELINE = "B0h"
# the 1.0.7 driver (its BoundedVocoder after the flow step): cells ending in "n", gated against B0n
NEW_BASELINE = "B0n"
OPT_CELLS = {
    "S": dict(state=True, replay="off", granularity="chunk"),
    "R": dict(state=False, replay="auto", granularity="step"),
    "Rc": dict(state=False, replay="auto", granularity="chunk", step_segments=True),
    "SR": dict(state=True, replay="auto", granularity="step"),
    "SRc": dict(state=True, replay="auto", granularity="chunk", step_segments=True),
    # the whole CFM loop as one graph: nothing hides its launch, where SRc launches each solver step's
    # graph while the previous step's runs
    "SRc1": dict(state=True, replay="auto", granularity="chunk", step_segments=False),
    # SRc without the default program's undo log (optimize(..., transactional=False)): what the
    # transaction costs per call
    "SRcnt": dict(state=True, replay="auto", granularity="chunk", step_segments=True, transactional=False),
    "SRch": dict(state=True, replay="auto", granularity="chunk", step_segments=True, float16=True),
    # SRc / SRch on one stream per graph: what replay="auto" gave a one-lane program before session 26
    "SRcs": dict(state=True, replay="auto", granularity="chunk", step_segments=True, branches=1),
    "SRchs": dict(state=True, replay="auto", granularity="chunk", step_segments=True, float16=True, branches=1),
    # SRc / SRch with each graph's independent chains captured on parallel streams (cadence_fx.analysis.branch_plan)
    "SRcb": dict(state=True, replay="auto", granularity="chunk", step_segments=True, branches=3),
    "SRchb": dict(state=True, replay="auto", granularity="chunk", step_segments=True, float16=True, branches=3),
    # SRchb with the matrix products on two of the three streams: one cuBLAS workspace fewer
    "SRchb2": dict(state=True, replay="auto", granularity="chunk", step_segments=True, float16=True, branches=3,
                   blas_streams=2),
    "SRcn": dict(state=True, replay="auto", granularity="chunk", step_segments=True, driver="1.0.7"),
}
RESTORE_SNAPSHOT, RESTORE_AT = 8, 12
EXPORT_SEED = 99  # token stream the catalog is exported from (not a benchmark block)
UPSTREAM_FOLDERS = {"0.1.2": "minicpmo-0.1.2", "1.0.7": "minicpmo-utils-1.0.7"}
VOCODER_EXAMPLE_CHUNKS = 6  # mel chunks streamed to find the BoundedVocoder's decode shapes (SRcn)


# --------------------------------------------------------------------------- building
def _upstream(driver: str = "0.1.2"):
    from cadence_fx.adapters.stepaudio2 import load_stepaudio2

    root = Path(os.environ.get("CADENCE_FX_UPSTREAM", ROOT / ".upstream"))
    return load_stepaudio2(root / UPSTREAM_FOLDERS[driver])


def build_step(args, device: str, *, float16: bool = False, driver: str = "0.1.2"):
    """The stock step from the benchmark seed, on ``device``; returns (t2w, cfg, step, prompt).

    ``float16``: the stock driver's switch (``Token2wav(float16=True)``): the flow in half (same seeded
    weights, cast), run under float16 autocast; the vocoder stays float32. ``driver="1.0.7"``: the
    1.0.7 release's flow and trims, no vocoder in the step (its ``BoundedVocoder`` runs after the step:
    :func:`build_bounded`, :class:`BoundedStream`)."""
    from cadence_fx.adapters import token2wav as t2w

    cfg = t2w.Token2WavConfig.reduced() if args.reduced else t2w.Token2WavConfig()
    torch.manual_seed(cfg.seed)
    up = _upstream(driver)
    flow = t2w.build_flow(up, cfg)
    vocoder = t2w.build_vocoder(up, cfg) if driver == "0.1.2" else None
    step = t2w.Token2WavStep(flow.half() if float16 else flow, vocoder, cfg, driver=driver,
                             float16=float16).to(device).eval()
    return t2w, cfg, step, tuple(t.to(device) for t in t2w.example_prompt(cfg))


def build_bounded(cfg, device: str):
    """The 1.0.7 ``BoundedVocoder`` (seeded causal HiFT) on ``device``, reset as ``set_stream_cache`` leaves
    it. As ``load_causal_vocoder`` does, only the model moves (``.float().to(device)``); the oscillator's
    noise table (a plain attribute) stays on the host."""
    from cadence_fx.adapters import token2wav as t2w

    up = _upstream("1.0.7")
    hift = t2w.build_causal_vocoder(up, cfg).model
    return t2w.new_bounded_stream(up, hift.float().to(device).eval())


class BoundedStream:
    """The 1.0.7 stream as one call: the flow step (``flow_fn``: the stock ``driver_call`` or the optimized
    program), then the ``BoundedVocoder`` on its mel as ``Token2wav._stream_vocode`` runs it. Outputs
    ``(speech, mel, flow state...)``; the flow state is carried as the step carries it.

    The vocoder's state is host-side, outside the carried tensors: its cache dict, mutated in place
    (``fill_``, ``zero_``) and replaced between calls. :meth:`host_snapshot` deep-copies it to the host
    (every tensor cloned, with the device it lives on, and the ``maxima`` bookkeeping);
    :meth:`host_restore` installs a copy on those devices, as the 1.0.7 driver restores the dict on a
    turn reset. Each block starts from the reset dict (:attr:`host_initial`)."""

    def __init__(self, step, vocoder, flow_fn) -> None:
        self.step, self.vocoder, self.flow_fn = step, vocoder, flow_fn
        self.inputs = step.inputs
        self.host_initial = self.host_snapshot()

    def fresh(self, *a, **kw):
        return self.step.fresh(*a, **kw)

    def next_args(self, fresh, state):
        return self.step.next_args(fresh, state)

    def carry(self, outputs):
        return self.step.carry(outputs[1:])

    def __call__(self, *args):
        return self._vocode(self.flow_fn(*args))

    def stream(self, fresh, state):
        """The stock stream, the state handed over (``flow_fn`` is ``driver_stream``; see ``_stream``)."""
        return self._vocode(self.flow_fn(fresh, state))

    def _vocode(self, out):
        from cadence_fx.adapters.token2wav import bounded_vocoder_stream

        return (bounded_vocoder_stream(self.vocoder, out[0], self.step.cfg), *out)

    def host_snapshot(self) -> tuple[dict, dict]:
        cache = {k: (v.to("cpu", copy=True), v.device) for k, v in self.vocoder.cache.items()}
        return cache, dict(self.vocoder.maxima)

    def host_restore(self, snapshot: tuple[dict, dict]) -> None:
        cache, maxima = snapshot
        self.vocoder.cache = {k: v.to(dev, copy=True) for k, (v, dev) in cache.items()}
        self.vocoder.maxima = dict(maxima)


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------- streaming
def _stream(fn, step, state0: dict, fresh, seed: int, restore: bool, device: str, profile: bool,
            on_host: frozenset[str] = frozenset(), owned: bool = False):
    """One block from the host-held initial state; returns (per-chunk ms, PCM sha256, profile).

    ``owned``: ``fn(fresh, state)`` takes the state dict over (the stock driver's ``driver_stream``,
    which empties it), so this loop holds no reference to the previous state through the call, as
    ``Token2wav.stream`` holds none; otherwise ``fn(*args)``.

    ``on_host``: state inputs passed from the host at the block's start and at the restore (an optimized
    program's regions: it copies them into its buffers). A device copy of them would sit next to the
    region buffers through the first call, in the peak, and no deployment needs it.
    """
    torch.manual_seed(seed)
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    st = {k: v if k in on_host else v.to(device, copy=True) for k, v in state0.items()}
    # state held outside the carried tensors (the 1.0.7 BoundedVocoder's cache dict): restored with them
    host = hasattr(step, "host_restore")
    if host:
        step.host_restore(step.host_initial)
    pcm, ms, snapshot, host_snapshot = [], [], None, None
    for k, f in enumerate(fresh):
        if restore and k == RESTORE_AT:
            # foreign tensors: a turn boundary. The carried state goes first, as a driver replacing its
            # cache dict drops the old one; else both would sit in the restore block's peak
            st.clear()
            st = {n: t if n in on_host else t.to(device, copy=True) for n, t in snapshot.items()}
            if host:
                step.host_restore(host_snapshot)
        args = (f, st) if owned else step.next_args(f, st)
        with torch.no_grad():
            out, t = harness.timed(fn, *args)
        ms.append(t)
        pcm.append(out[0].detach().to("cpu", copy=True))
        st = step.carry(out)
        del out, args
        if restore and k == RESTORE_SNAPSHOT:
            # an optimized program's state may be a strided view of its buffer (the envelope layout):
            # state_to copies it out without a full-size staging copy on the GPU
            snapshot = {n: state_to(t, "cpu") if n in on_host else t.to("cpu", copy=True) for n, t in st.items()}
            host_snapshot = step.host_snapshot() if host else None
    prof = None
    if profile:  # one extra call after the timed stream, so profiling never distorts a timing
        args = (fresh[-1], st) if owned else step.next_args(fresh[-1], st)
        with torch.no_grad():
            prof = harness.profile_calls(lambda: fn(*args), calls=1)
    return ms, sha256_tensors(pcm), prof


def _row(name, block, ms, sha, prof, warm, notes="", **extra):
    prof = prof or {}
    nan = float("nan")
    return dict(name=name, block=block, p50_ms=harness.percentile(ms, 50), p95_ms=harness.percentile(ms, 95),
                peak_mib=harness.peak_mib(), kernels_per_chunk=prof.get("kernels", nan),
                launches_per_chunk=prof.get("launches", nan), busy_ms=prof.get("busy_ms", nan), warmup_s=warm,
                sha256=sha, notes=notes, ms=ms, **{k: prof[k] for k in harness.GAP_FIELDS if k in prof}, **extra)


def _ready(device: str) -> None:
    """The cell is built: drop garbage and start counting the peak."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _blocks(args, name, fn, step, state0, spk, device, warm, counts=lambda: None,
            describe=lambda before, after: "", on_host: frozenset[str] = frozenset(), owned: bool = False,
            **extra) -> list[dict]:
    """Stream every block; ``describe(counts() before, counts() after)`` is the block's note."""
    rows = []
    for block in range(args.blocks):
        fresh = step.fresh(args.chunks, spk, seed=block)
        restore = block == args.blocks - 1
        before = counts()
        ms, sha, prof = _stream(fn, step, state0, fresh, 1000 + block, restore, device, block == 0, on_host, owned)
        if block == 0 and args.memory_peak and device == "cuda":
            harness.write_memory_peak(args.memory_peak, name)
        notes = ", ".join(x for x in (describe(before, counts()), "restore" if restore else "") if x)
        rows.append(_row(name, block, ms, sha, prof, warm, notes, **extra))
        print(f"[{name} block {block}] p50 {rows[-1]['p50_ms']:.1f} ms, peak {rows[-1]['peak_mib']} MiB, {notes}",
              file=sys.stderr, flush=True)
    return rows


def run_stock_cell(args, name: str) -> list[dict]:
    pin_envelope()
    env = describe_envelope()
    device = pick_device()
    half = name == HALF_BASELINE
    driver = "1.0.7" if name == NEW_BASELINE else "0.1.2"
    t2w, cfg, step, (tokens, mel, spk) = build_step(args, device, float16=half, driver=driver)
    state0 = {k: v.cpu() for k, v in step.setup(tokens, mel, spk).items()}
    own = {HALF_BASELINE: HALF_BASELINE, NEW_BASELINE: NEW_BASELINE}.get(name)
    extra: dict = {"lane": args.lane, **({"baseline": own} if own else {})}
    fn = step.driver_stream  # the state handed over: nothing here keeps the previous one alive
    if driver == "1.0.7":  # the stream: the step, then its BoundedVocoder on the step's mel, eagerly
        step = BoundedStream(step, build_bounded(cfg, device), step.driver_stream)
        fn = step.stream
    warm = 0.0
    counter = {"n": 0}
    if name in ("B0", HALF_BASELINE, NEW_BASELINE):
        # the envelope check: the stock code must reproduce its own bytes before any comparison
        fresh = step.fresh(args.chunks, spk, seed=0)
        a = _stream(fn, step, state0, fresh, 1000, False, device, False, owned=True)[1]
        b = _stream(fn, step, state0, fresh, 1000, False, device, False, owned=True)[1]
        extra.update(reproducible=a == b, envelope={k: str(v) for k, v in env.items()},
                     gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__)
    elif name == "vendor":
        t0 = time.perf_counter()
        step.flow.scatter_cuda_graph(True)
        warm = time.perf_counter() - t0
        _count_vendor_replays(step, counter)
    elif name == "vendor_live":
        t0 = time.perf_counter()
        _rebucket_vendor(step, state0, spk, device)
        warm = time.perf_counter() - t0
        _count_vendor_replays(step, counter)
    elif name == "compile":
        est = step.flow.decoder.estimator
        est.forward_chunk = torch.compile(est.forward_chunk, mode="reduce-overhead", dynamic=False)
        t0 = time.perf_counter()
        # compile and record every history extent the stream meets (three passes over the catalog:
        # cudagraph trees warm up, then record, before they replay)
        for rep in range(3):
            _stream(fn, step, state0, step.fresh(4, spk, seed=EXPORT_SEED + rep), 0, False, device, False, owned=True)
        warm = time.perf_counter() - t0
    _ready(device)
    if args.memory_peak and device == "cuda":
        harness.record_memory()
    if not name.startswith("vendor"):
        return _blocks(args, name, fn, step, state0, spk, device, warm, owned=True, **extra)
    buckets = sorted(step.flow.decoder.estimator.graph_chunk)
    return _blocks(args, name, fn, step, state0, spk, device, warm, lambda: counter["n"],
                   lambda b, a: f"vendor graph replays {a - b} (buckets {buckets})", owned=True, **extra)


def run_opt_cell(args, name: str) -> list[dict]:
    import cadence_fx as cf

    pin_envelope()
    spec = OPT_CELLS[name]
    device = pick_device()
    warnings = harness.library_warnings()  # a refused capture's error, kept in the row
    half = spec.get("float16", False)
    driver = spec.get("driver", "0.1.2")
    hift = driver == "0.1.2"  # 1.0.7: no vocoder in the step (its BoundedVocoder runs after it)
    t2w, cfg, step, (tokens, mel, spk) = build_step(args, device, float16=half, driver=driver)
    state0 = step.setup(tokens, mel, spk)
    contract = t2w.token2wav_contract(cfg, spec["granularity"], driver=driver, vocoder=hift,
                                      step_segments=spec.get("step_segments", False))
    t0 = time.perf_counter()
    # the "step" routing installs both the CFM-loop and the estimator proxies: one export serves both clocks
    eps = t2w.export_step_catalog(step, state0, step.fresh(3, spk, seed=EXPORT_SEED),
                                  t2w.token2wav_contract(cfg, "step", driver=driver, vocoder=hift), granularity="step")
    export_s = time.perf_counter() - t0
    state0 = {k: v.cpu() for k, v in state0.items()}
    t0 = time.perf_counter()
    replay = spec["replay"]
    if "branches" in spec and device == "cuda":  # SRcs: one stream, named (``replay="auto"`` branches one lane)
        from cadence_fx.runtime.backends import CudaGraphBackend

        replay = CudaGraphBackend(branches=spec["branches"], blas_streams=spec.get("blas_streams"))
    prog = cf.optimize(eps, contract, replay=replay, state=spec["state"], transactional=spec.get("transactional", True))
    optimize_s = time.perf_counter() - t0
    del eps
    released = release_unreferenced(step, prog)
    _ready(device)
    memory = {"after_optimize_mib": torch.cuda.memory_allocated() / 2**20 if device == "cuda" else None,
              "released_stock_mib": released / 2**20}
    # only the per-call inputs: warm-up captures on views of the region buffers, no state is needed
    first = step.fresh(1, spk)[0]
    if (args.memory_top or args.memory_peak) and device == "cuda":
        harness.record_memory()
    warm = prog.warmup(*[first.get(n) for n in step.inputs])["seconds"]
    fn, counts, decode, vocoder = prog, prog.counters, None, {}
    if not hift:
        # the 1.0.7 BoundedVocoder after the step, its decode exported per shape seen on example mel,
        # optimized and captured here (warm-up, not timed); the mel values do not matter, only the shapes
        from cadence_fx.adapters.bounded_vocoder import replay_bounded_vocoder

        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(EXPORT_SEED)
        example = [torch.randn(1, cfg.mel_channels, cfg.chunk_frames, generator=g).to(device)
                   for _ in range(VOCODER_EXAMPLE_CHUNKS)]
        bounded = build_bounded(cfg, device)
        decode = replay_bounded_vocoder(bounded, example, replay=spec["replay"])
        vocoder = dict(replay_s=time.perf_counter() - t0, decode_catalog=len(decode.catalog))
        warm += vocoder["replay_s"]
        fn = step = BoundedStream(step, bounded, prog)
        counts = lambda: dict(flow=prog.counters(), decode=decode.counters())  # noqa: E731
    if args.memory_top and device == "cuda":
        _write_memory_top(args.memory_top, name)
    if device == "cuda":
        memory.update(after_warmup_mib=torch.cuda.memory_allocated() / 2**20,
                      warmup_peak_mib=torch.cuda.max_memory_allocated() / 2**20, **_census_mib(prog))

    def flow_note(before, c):
        rej = {k: v - before["rejections"].get(k, 0) for k, v in c["rejections"].items()
               if v - before["rejections"].get(k, 0)}
        return f"replays {c['replays'] - before['replays']}, eager {c['eager'] - before['eager']}" + (f" {rej}" if rej else "")

    def describe(before, c):
        if decode is None:
            return flow_note(before, c)
        b, a = before["decode"], c["decode"]
        replays = sum(r["replays"] for r in a["replay"].values()) - sum(r["replays"] for r in b["replay"].values())
        inner = sum(r["eager"] for r in a["replay"].values()) - sum(r["eager"] for r in b["replay"].values())
        stock = sum(a["eager"].values()) - sum(b["eager"].values())
        return (f"{flow_note(before['flow'], c['flow'])}; vocoder decode: optimized {a['optimized'] - b['optimized']} "
                f"(replays {replays}, eager {inner}), stock fallbacks {stock}")

    gate = {"baseline": HALF_BASELINE} if half else {"baseline": NEW_BASELINE} if not hift else {}
    on_host = frozenset(r.input for r in contract.regions) if spec["state"] else frozenset()
    rows = _blocks(args, name, fn, step, state0, spk, device, warm, counts, describe, on_host, lane=args.lane, **gate,
                   export_s=export_s, optimize_s=optimize_s, passes=prog.stats["passes"], memory=memory,
                   **({"vocoder": vocoder} if vocoder else {}))
    progs = {"": prog, **({f"vocoder.decode/finalize={f}/": p for f, p in decode.programs.items()} if decode else {})}
    reports = {prefix + k: [dict(admitted=r.admitted, reason=r.reason, effect=r.effect, graph_mib=r.graph_bytes / 2**20,
                                 staging_mib=r.staging_bytes / 2**20, capture_s=r.capture_seconds, error=r.error)
                            for r in eng.classes.values()]
               + [dict(refused=reason) for reason in set(eng.refusals().values())]
               for prefix, p in progs.items() for k, eng in p.runners().items()}
    rows[-1]["capture_reports"] = reports
    rows[-1]["library_warnings"] = warnings
    branches = harness.branch_summary(progs.values())
    if branches:  # the parallel-branch cells: how much of each graph left the capture stream
        rows[-1]["branches"] = branches
    if decode is not None:
        rows[-1]["vocoder"] = dict(vocoder, eager_signatures={str(k): n for k, n in decode.counters()["eager"].items()})
    return rows


def release_unreferenced(step, prog) -> int:
    """Free the stock module's buffers no optimized graph uses (its workspaces); returns the bytes.

    The cell never calls the stock module again (it only drives inputs and state), and a deployment
    drops the stock module once the program is built. Parameters are shared with the program. A
    storage that cannot be resized (host memory borrowed from numpy, on the CPU) is left alone.
    """
    used = set(prog.owned_storages())
    for gm in prog.graph_modules():
        for t in list(gm.parameters()) + list(gm.buffers()):
            used.add(t.untyped_storage().data_ptr())
    freed = 0
    for _name, buf in step.named_buffers():
        storage = buf.untyped_storage()
        if storage.data_ptr() not in used and storage.nbytes() and storage.resizable():
            freed += storage.nbytes()
            storage.resize_(0)
    return freed


def _write_memory_top(path: str, name: str, top: int = 25) -> None:
    """The largest device blocks still allocated after warm-up, with where they were allocated."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    blocks = [(b["size"], b.get("frames", []), seg.get("segment_pool_id")) for seg in snap["segments"]
              for b in seg["blocks"] if b["state"] == "active_allocated"]
    blocks.sort(key=lambda b: -b[0])
    with open(path, "a") as f:
        f.write(f"== {name}: {len(blocks)} live blocks, {sum(b[0] for b in blocks) / 2**20:.1f} MiB\n")
        for size, frames, pool in blocks[:top]:
            where = [f"{fr['filename'].split('/')[-1]}:{fr['line']}:{fr['name']}" for fr in frames
                     if fr["filename"].endswith(".py") or fr["filename"].startswith("<eval")][:6]
            f.write(f"{size / 2**20:9.1f} MiB pool={pool} {' <- '.join(where)}\n")


CENSUS_FIELDS = {"parameters": "parameters_mib", "constants": "buffers_and_constants_mib", "regions": "regions_mib",
                 "workspaces": "workspaces_mib", "graph_pools": "graph_pool_reserved_mib", "staging": "staging_mib"}


def _census_mib(prog) -> dict:
    """Where the optimized program's device memory is (weights, state, workspaces, graphs, staging), as
    the rows' ``memory`` fields in MiB."""
    return {CENSUS_FIELDS.get(kind, f"{kind}_mib"): nbytes / 2**20 for kind, nbytes in prog.memory_census().items()}


def _count_vendor_replays(step, counter: dict) -> None:
    dit = step.flow.decoder.estimator

    class Counting:
        def __init__(self, g):
            self.g = g

        def replay(self):
            counter["n"] += 1
            self.g.replay()

    for k in list(dit.graph_chunk):
        dit.graph_chunk[k] = Counting(dit.graph_chunk[k])


def _rebucket_vendor(step, state0: dict, spk, device: str) -> None:
    """Give the vendor branch one bucket at the live estimator call size, padded to the longest history.

    The vendor's own ``blocks_forward_chunk`` is captured on static buffers laid out the way its
    padded branch fills them (mask and attention cache padded to ``max_size``); the sizes are read
    from one real estimator call, so nothing is hard-coded. At run time the vendor's code decides,
    copies and replays, exactly as it does for its shipped buckets.
    """
    dit = step.flow.decoder.estimator
    seen: dict = {}
    original = dit.blocks_forward_chunk

    def spy(x, t, mask, cnn_cache, att_cache, cnn_buf, att_buf):
        seen.setdefault("args", (x, t, cnn_cache, att_cache))
        return original(x, t, mask, cnn_cache, att_cache, cnn_buf, att_buf)

    dit.blocks_forward_chunk = spy
    try:
        _stream(step.driver_call, step, state0, step.fresh(3, spk, seed=EXPORT_SEED), 0, False, device, False)
    finally:
        del dit.blocks_forward_chunk
    x, t, cnn_cache, att_cache = seen["args"]
    chunk = x.shape[2]  # x arrives as (batch, channels, frames)
    max_size = step.cfg.prompt_frames + step.cfg.history_frames  # the longest history the trim leaves
    f32 = dict(dtype=x.dtype, device=x.device)
    static_x, static_t = torch.zeros_like(x), torch.zeros_like(t)
    static_mask = torch.ones(x.shape[0], chunk, max_size + chunk, dtype=torch.bool, device=x.device)
    static_cnn = torch.zeros_like(cnn_cache)
    att_shape = list(att_cache.shape)
    att_shape[-2] = max_size
    static_att = torch.zeros(att_shape, **f32)
    new_cnn = torch.zeros_like(cnn_cache)
    new_att = torch.zeros(att_shape[:-2] + [max_size + chunk, att_shape[-1]], **f32)
    static_in = [static_x, static_t, static_mask, static_cnn, static_att]
    with torch.no_grad():
        original(*static_in, new_cnn, new_att)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = original(*static_in, new_cnn, new_att)
    dit.inference_buffers_chunk[chunk] = {"static_inputs": static_in, "static_outputs": [out, new_cnn, new_att]}
    dit.graph_chunk[chunk] = graph
    dit.max_size_chunk[chunk] = max_size
    dit.use_cuda_graph = True


# --------------------------------------------------------------------------- driver
ROW_FIELDS = ("name", "run", "block", "lane", "p50_ms", "p95_ms", "peak_mib", "kernels_per_chunk", "launches_per_chunk",
              "busy_ms", *harness.GAP_FIELDS, "warmup_s", "sha256", "bitexact", "speedup", "notes", "ms", "error", "process_s", "export_s", "optimize_s",
              "memory", "capture_reports", "baseline", "vocoder", "branches",
              "library_warnings")  # what the --json report keeps of each row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (CPU smoke run)")
    ap.add_argument("--memory-top", default=None, help="append the largest live blocks after warm-up to this file")
    ap.add_argument("--memory-peak", default=None,
                    help="append what was live at the device peak of warm-up + the first block to this file")
    harness.add_flags(ap, cells="B0,vendor,vendor_live,compile,S,R,Rc,SR,SRc,SRc1", blocks=4)
    args = ap.parse_args()
    if args.one:
        harness.write_cell(args.out, run_stock_cell(args, args.one) if args.one in STOCK_CELLS
                           else run_opt_cell(args, args.one))
        return
    common = ["--blocks", str(args.blocks), "--chunks", str(args.chunks)] + (["--reduced"] if args.reduced else [])
    if args.memory_top:
        common += ["--memory-top", args.memory_top]
    if args.memory_peak:
        common += ["--memory-peak", args.memory_peak]
    report(harness.collect(args, __file__, common, per_block=False), args)


def report(cells: list[dict], args) -> None:
    """Print the table and the per-cell summary of gated rows, save the JSON report."""
    lanes_agree = harness.baselines_agree(cells)
    env = next((r for r in cells if r.get("envelope")), {})
    exp = next((r for r in cells if r.get("export_s")), {})
    gpu = env.get("gpu") or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print(f"Token2Wav {'reduced' if args.reduced else 'released'} sizes, {args.blocks} blocks x {args.chunks} chunks, "
          f"{gpu}, torch {env.get('torch', torch.__version__)}, {date.today()}; baseline reproduces itself under the "
          f"envelope: {env.get('reproducible')}; lanes' B0 bytes agree: {lanes_agree}; export of the catalog: "
          f"{exp.get('export_s', float('nan')):.1f} s")
    print(harness.table(cells))
    for r in cells:
        for line in (r.get("library_warnings") or [])[:3]:  # a refused capture says why here
            print(f"{r['name']:<10}cadence_fx: {line[:300]}")
    summary = harness.summarize(cells)
    print("per-cell medians over blocks (speedup only where every block is bit-exact):")
    print(json.dumps(summary, indent=1))
    if args.json:
        harness.write_json(args.json, dict(gpu=gpu, torch=env.get("torch", torch.__version__), date=str(date.today()),
                                           envelope=env.get("envelope"), reproducible=env.get("reproducible"),
                                           lanes_b0_agree=lanes_agree, export_s=exp.get("export_s"),
                                           cells=[{k: r[k] for k in ROW_FIELDS if k in r} for r in cells],
                                           summary=summary))


if __name__ == "__main__":
    main()
