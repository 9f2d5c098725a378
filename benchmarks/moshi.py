"""Moshi (Kyutai's full-duplex speech model, ``moshi`` 0.2.13 from PyPI): one full-duplex stream per cell.

    python benchmarks/moshi.py --frames 1000 --json docs/results/moshi-h200.json --rows .out/moshi-rows.jsonl

Released dimensions (7B temporal transformer + depformer in bf16, Mimi in fp32 with 8 codebooks),
random weights built directly on the GPU, batch 1, ``LMGen``'s default sampling (device RNG). Each
frame (80 ms of audio): Mimi encodes the user's 1920 samples, ``LMGen`` samples the text token and
the model's 8 audio codes, Mimi decodes them (from frame 1 on, when ``LMGen.step`` first returns
tokens). Cells:

- ``B0``      the stock code as shipped, eager (``NO_CUDA_GRAPH=1``): ``mimi.encode``, ``LMGen.step``,
              ``mimi.decode``, each module keeping its own streaming state;
- ``B0b``     B0 again, in a process of its own, gated against B0: is the stock eager stream itself
              reproducible (its logits included)?
- ``vendor``  the same with moshi's own ``CUDAGraphed`` replay as shipped (``forward_text`` and
              ``depformer_step`` of the LM, Mimi's SEANet encoder/decoder and transformers; captured
              on the second call, eager glue between the graphs);
- ``S``       the exported steps under the state rule only (contract-owned rings, no replay);
- ``R``       replay only (one CUDA graph per step: the whole LM frame, sampling included; Mimi encode;
              Mimi decode), the state staged in and out of the graphs as plain inputs;
- ``SR``      both rules: the graphs run on the region buffers, nothing staged;
- ``SRnt``    SR without the undo log of the default programs (``transactional=False``): beside SR,
              what keeping the state through a call that raises costs per frame;
- ``SRb``     SR with each graph's independent chains captured on up to three parallel streams of the
              graph (``CudaGraphBackend(branches=3)``, ``cadence_fx.analysis.branch_plan``): the same kernels;
- ``E``       the exported steps as torch.export gives them (``ep.module()``), no cadence_fx: the program
              every optimized cell must equal, run against the stock code it was exported from;
- ``Snh``     S with Mimi's encode and decode contracts hoisting nothing (``hoist_constants=False,
              fold_weights=False``: weight norm and constant cones inline every call, as the stock code).

Every cell runs with ``NO_TORCH_COMPILE=1``: moshi compiles its RMS norm, RoPE and gating kernels
with ``torch.compile`` on CUDA by default, whose fused kernels differ from the eager ones in bits,
and an exactness gate needs one set of kernels for every cell.

Process layout: **every cell runs in a fresh process** (``benchmarks/harness.py``), builds the
stack from the benchmark seed, and streams ``--frames`` frames of seeded noise as the user's audio
from the initial state, with the same sampling seed. Optimized cells export the three steps, optimize
them, free the upstream modules' own copy of the state (the program owns it) and warm up (capture)
before the stream. The gate: SHA-256 of every frame's tokens (text token + audio codes) and PCM
against B0's; a cell whose bytes differ is NOT EXACT and gets no speedup. Each row keeps every frame's
tokens and a short digest of every frame's PCM (raw rows only, ``--rows``), so the report says for each
cell where its stream parts from B0's: the first frame whose tokens differ and in which entry (text or
audio codebook K), and the first frame whose PCM differs; and which kernels its profiled frame runs more
or fewer times than B0's (``kernel_diff``: whole kernel names with their template arguments, and each
name's launches per frame in both). Every row also keeps per-frame digests of where the stream is made
(``digests``, see ``lm_probe``; exact: bytes copied to the host and hashed): the LM step's input codes
(Mimi's encoding), the KV entries each frame wrote (one digest per frame and one per layer), every
``--kv-full-every`` frames the whole written part of the KV rings, the LM's counters and token ring, the
tokens each frame sampled before the delays, and for the eager stock cells (B0, B0b) the text logits, the
depformer's input and each codebook's logits (not reachable inside an exported program). The report says,
per cell vs B0, the first frame each digest differs (for the KV entries: which layers). Reported per cell: p50/p95
ms per frame (encode + LM + decode, each stage synchronised so its time is known) and of the LM step
alone, peak MiB (``torch.cuda.max_memory_allocated`` from the moment the cell is ready to serve:
weights, state, graph pools, warm-up included; building, export and optimize excluded, for every cell
alike, and so are the library workspaces the build cached, which a process that loads a saved program
never makes; the KV digests copy to the host with no device temporary, so no harness copy is counted),
kernels and host launches per frame (one extra profiled frame after the timed stream; each stage's wall
time split into lead, node switches and host waits: ``stage_gaps``), and for
the optimized cells export/optimize/warm-up seconds, replays and eager fallbacks, and the state the
program owns (regions, MiB, regions written whole per call, state inputs used in place).

``--reduced`` runs the reduced configuration of the CPU tests (a smoke run; on the CPU there is no
replay and no vendor graph).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable

# before moshi is imported: its torch.compile wrappers read this once, at import
os.environ.setdefault("NO_TORCH_COMPILE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from cadence_fx.determinism import describe_envelope, pin_envelope, sha256_tensors  # noqa: E402

STOCK_CELLS = ("B0", "B0b", "vendor")
OPT_CELLS = {"S": dict(state=True, replay="off"), "R": dict(state=False, replay="auto"),
             "SR": dict(state=True, replay="auto"),
             # SR without the default programs' undo logs (transactional=False): what keeping the state
             # through a call that raises costs per frame
             "SRnt": dict(state=True, replay="auto", transactional=False),
             # SR with each graph's independent chains captured on up to three parallel streams
             "SRb": dict(state=True, replay="auto", branches=3),
             # the exported steps run unmodified (``ep.module()``, no cadence_fx): where a cell parts from B0,
             # says whether torch.export's program already does (then no pass is to blame)
             "E": dict(state=False, replay="off", exported=True),
             # S with Mimi's constants and weight-derived cones computed inline every call (no hoisting)
             "Snh": dict(state=True, replay="off", mimi_hoist=False)}
STAGES = ("encode", "lm", "decode")
SAMPLING_SEED = 1234
AUDIO_SEED = 99
PCM_DIGEST = 12  # hex digits of each frame's PCM digest kept in a row (and of every per-frame digest)
LAYER_DIGEST = 8  # hex digits of each layer's KV digest per frame
KV_FULL_EVERY = 8  # frames between digests of the whole written part of every LM KV ring


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build(args, device: str):
    """The upstream modules at the configuration, as the three steps; returns (mo, up, cfg, steps)."""
    from cadence_fx.adapters import moshi as mo

    up = mo.load_moshi()
    cfg = mo.MoshiConfig.reduced() if args.reduced else mo.MoshiConfig()
    t0 = time.perf_counter()
    steps = mo.build_steps(up, cfg, device)
    harness.sync()
    print(f"[build] {time.perf_counter() - t0:.1f} s on {device}", file=sys.stderr, flush=True)
    return mo, up, cfg, steps


def _ready(device: str, args, name: str) -> None:
    """The cell is built: drop garbage and the build's cached library workspaces, and start counting the
    peak (``--memory-ready``: first write what is live, by where it was allocated since the process
    began)."""
    gc.collect()
    if device == "cuda":
        harness.release_library_workspaces()
        torch.cuda.empty_cache()
        if args.memory_ready:
            harness.write_memory_live(args.memory_ready, name)
            torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.reset_peak_memory_stats()


# --------------------------------------------------------------------------- the timed stream
def stream(stages: dict[str, Callable[[torch.Tensor], torch.Tensor]], pcm: list[torch.Tensor], max_delay: int,
           device: str, probe: Callable[[int], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run every frame through ``stages`` (encode, lm, decode), each stage synchronised and timed.

    Returns per-frame and per-stage milliseconds and the SHA-256 of the tokens, of the PCM and of both
    (frame by frame: tokens, then PCM where there is any), copied to the host outside the timings; and,
    to say where two streams part, every frame's tokens (``frame_tokens``: small ints, ``B * (1 + dep_q)``
    per frame) and a short digest of every frame's PCM (``frame_pcm``, ``None`` before the first decode).

    ``digests``: per-frame records by name (one list entry per frame), taken after each frame outside the
    timings: ``codes`` (digest of the LM step's input, Mimi's encoding of the frame) always, and whatever
    ``probe(k)`` returns (:func:`lm_probe`).
    """
    torch.manual_seed(SAMPLING_SEED)
    if device == "cuda":
        torch.cuda.manual_seed(SAMPLING_SEED)
    ms = {name: [] for name in ("frame", *STAGES)}
    tokens, audio, both = [], [], []
    digests: dict[str, list] = {"codes": []}
    with torch.no_grad():
        for k, x in enumerate(pcm):
            codes, t_enc = harness.timed(stages["encode"], x)
            tok, t_lm = harness.timed(stages["lm"], codes)
            out, t_dec = harness.timed(stages["decode"], tok[:, 1:]) if k >= max_delay else (None, 0.0)
            ms["encode"].append(t_enc)
            ms["lm"].append(t_lm)
            ms["decode"].append(t_dec)
            ms["frame"].append(t_enc + t_lm + t_dec)
            tokens.append(tok.to("cpu", copy=True))
            both.append(tokens[-1])
            if out is not None:
                audio.append(out.to("cpu", copy=True))
                both.append(audio[-1])
            digests["codes"].append(_digest(codes))
            for key, v in (probe(k) if probe is not None else {}).items():
                digests.setdefault(key, [None] * k).append(v)
    pcm_at = iter(audio)
    return dict(ms=ms, sha256=sha256_tensors(both), sha256_tokens=sha256_tensors(tokens),
                sha256_pcm=sha256_tensors(audio), first_tokens=[t.flatten().tolist() for t in tokens[:4]],
                frame_tokens=[t.flatten().tolist() for t in tokens], tokens_shape=list(tokens[0].shape[:2]),
                frame_pcm=[None if k < max_delay else sha256_tensors(next(pcm_at))[:PCM_DIGEST]
                           for k in range(len(tokens))], digests=digests)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to a contiguous host tensor with no device temporary: a device ``.contiguous()`` (or
    ``.cpu()`` of a strided view, which makes one) of every KV ring's written part would be the largest
    allocation of the stream, and the cell's peak would count the harness's copies rather than the model.
    The view is copied slab by slab, each slab a contiguous block of ``t``'s storage."""
    if t.is_contiguous() or t.numel() == 0:
        return t.to("cpu", copy=True).contiguous()
    lead = next(k for k in range(t.dim() + 1) if t[(0,) * k].is_contiguous())
    out = torch.empty(t.shape, dtype=t.dtype)
    for idx in itertools.product(*map(range, t.shape[:lead])):
        out[idx].copy_(t[idx])
    return out


def _digest(t: torch.Tensor | list[torch.Tensor], n: int = PCM_DIGEST) -> str:
    """The first ``n`` hex digits of the SHA-256 of the tensor's bytes (copied to the host: exact)."""
    return sha256_tensors(t)[:n]


# --------------------------------------------------------------------------- where two streams part
def lm_probe(step, state_of: Callable[[], dict[str, torch.Tensor]], *, kv_full_every: int = KV_FULL_EVERY,
             stash: dict | None = None) -> Callable[[int], dict[str, Any]]:
    """Per-frame records of the LM step's state after frame ``k`` (``probe(k)``, for :func:`stream`).

    ``state_of()`` gives the LM state by slot name (``StateSlot.name``): for the stock cells moshi's own
    streaming state (``slot.get()``), for the optimized cells the state the step returned (``carry``).
    Every record is exact (the bytes copied to the host and hashed), and the copies are small:

    - ``sampled``: the tokens the frame sampled, before the delays (text, audio 0..dep_q-1, per stream: the
      column of ``LMGen``'s token ring the frame wrote), as ints;
    - ``ring``: digest of the whole token ring (sampled tokens and the user's delayed codes);
    - ``counters``: digest of every position counter (``offset``, ``offsets``, ``end_offset``);
    - ``kv``: digest of the KV entries this frame wrote (position ``end_offset - 1`` of every temporal
      layer's ring: 16 KiB a layer released), and ``kv_layers``: one 8-digit digest per layer of the same;
    - ``kv_full``: every ``kv_full_every`` frames (frames ``kv_full_every - 1``, ``2 * kv_full_every - 1``,
      ...; else ``None``; 0: never), digest of every written position of every ring (positions
      ``0 .. min(end_offset, capacity) - 1``: about 0.5 MiB a frame of stream released);
    - with ``stash`` (:func:`stash_logits`, stock eager cells only: inside an exported program these
      tensors are not reachable without changing it): ``text_logits``, ``dep_input`` (the temporal
      transformer's output the depformer reads) and ``dep_logits`` (one 8-digit digest per codebook).
    """
    slots = step.slots
    dep_q = step.gen.lm_model.dep_q
    ring_name = next(s.name for s in slots if s.field == "tokens")
    ring_module = next(s.module for s in slots if s.field == "tokens")
    gen_offsets = next(s.name for s in slots if s.field == "offsets" and s.module == ring_module)
    kv = [(s.name, next(e.name for e in slots if e.module == s.module and e.field == "end_offset"))
          for s in slots if s.field == "kv_cache"]
    counters = [s.name for s in slots if s.field in ("offset", "offsets", "end_offset")]

    def probe(k: int) -> dict[str, Any]:
        st = state_of()
        ring, offsets = st[ring_name], st[gen_offsets]
        b, _, ct = ring.shape
        col = (offsets % ct).view(-1, 1, 1).expand(b, 1 + dep_q, 1)
        out: dict[str, Any] = {"sampled": ring[:, :1 + dep_q].gather(2, col).flatten().tolist(),
                               "ring": _digest(ring), "counters": _digest([st[n] for n in counters])}
        written = []
        for cache_name, end_name in kv:
            cache, end = st[cache_name], st[end_name]
            two, bb, h, cap, d = cache.shape
            written.append(cache.gather(3, ((end - 1) % cap).view(1, -1, 1, 1, 1).expand(two, bb, h, 1, d)))
        host = torch.stack(written).cpu() if written else torch.empty(0)
        out["kv"] = _digest(host)
        out["kv_layers"] = [_digest(t, LAYER_DIGEST) for t in host]
        out["kv_full"] = None
        if kv_full_every and (k + 1) % kv_full_every == 0:
            out["kv_full"] = _digest([host_copy(st[c].narrow(3, 0, min(int(st[e].max()), st[c].shape[3])))
                                      for c, e in kv])
        if stash is not None:
            out["text_logits"] = _digest(stash["text"]) if "text" in stash else None
            out["dep_input"] = _digest(stash["dep_input"]) if "dep_input" in stash else None
            out["dep_logits"] = [_digest(t, LAYER_DIGEST) for t in stash.get("dep", [])] or None
            stash.clear()
        return out

    return probe


def stash_logits(gen) -> dict:
    """Keep a reference (no copy, no kernel) to each frame's text logits (``LMGen.on_text_logits_hook``),
    the depformer's input and each codebook's logits (``lm_model.forward_depformer`` wrapped on the
    instance) in the returned dict, for :func:`lm_probe`. Eager stock cells only (a ``CUDAGraphed``
    depformer runs no Python on replay)."""
    stash: dict = {}
    lm = gen.lm_model
    forward_depformer = lm.forward_depformer

    def wrapped(cb_index, sequence, transformer_out):
        logits = forward_depformer(cb_index, sequence, transformer_out)
        stash.setdefault("dep", []).append(logits)
        stash["dep_input"] = transformer_out
        return logits

    lm.forward_depformer = wrapped
    gen.on_text_logits_hook = lambda logits: stash.__setitem__("text", logits)
    return stash


def _profile(stages, x: torch.Tensor) -> dict[str, Any]:
    """Kernels and launches of one more frame, after the timed stream (so profiling distorts no timing),
    counted as ``harness.profile_calls`` counts them, and the frame's launches per kernel name, names whole
    with their template arguments (``kernel_names``, to say which kernels a cell runs that B0 does not),
    and where each stage's wall time goes (``stage_gaps``)."""
    nan = float("nan")
    if not torch.cuda.is_available():
        return {"launches": nan, "kernels": nan, "busy_ms": nan}
    from torch.profiler import ProfilerActivity, profile, record_function

    harness.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.no_grad():
        # each stage synchronised, as in the timed stream, so its device work lies inside its host range
        with record_function("stage:encode"):
            codes = stages["encode"](x)
            harness.sync()
        with record_function("stage:lm"):
            tok = stages["lm"](codes)
            harness.sync()
        with record_function("stage:decode"):
            stages["decode"](tok[:, 1:])
            harness.sync()
    ev = harness.profile_events(prof, range_prefix="stage:")
    return {"launches": ev["launches"], "kernels": sum(ev["kernel_names"].values()), "busy_ms": ev["busy_ms"],
            "kernel_names": dict(ev["kernel_names"]), "stage_gaps": stage_gaps(ev["device"], ev["ranges"])}


def stage_gaps(device: list[tuple[float, float]], ranges: dict[str, tuple[float, float]]) -> dict[str, dict]:
    """Per stage of the profiled frame: where its wall time goes (``harness.device_gaps`` over the device
    intervals that start inside the stage's host range: its span, node switches, waits for the host,
    and the lead from the stage's call to its first device work), plus the stage's host ``wall_ms``."""
    out = {}
    for stage, (start, end) in ranges.items():
        mine = [iv for iv in device if start <= iv[0] <= end]
        gaps = harness.device_gaps(mine, start) if mine else {}
        out[stage] = {"wall_ms": (end - start) / 1e3, **gaps}
    return out


def kernel_diff(row: dict, base: dict, top: int | None = None) -> dict[str, int] | None:
    """Kernels per frame by (whole) name that ``row`` runs more (+) or fewer (-) times than ``base`` (every
    difference, or the largest ``top``), largest first; ``None`` without a per-name count."""
    a, b = row.get("kernel_names"), (base or {}).get("kernel_names")
    if not a or not b:
        return None
    diff = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}
    return dict(sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top])


def kernel_lines(row: dict, base: dict, diff: dict[str, int]) -> list[str]:
    """One line per kernel of ``diff``: the difference, the launches per frame of the cell and of the base,
    and the whole name."""
    a, b = row.get("kernel_names") or {}, base.get("kernel_names") or {}
    return [f"{v:+4d} ({a.get(k, 0):>4d} vs {b.get(k, 0):>4d})  {k}" for k, v in diff.items()]


def _row(name: str, res: dict, prof: dict | None, warm: float, notes: str = "", **extra) -> dict:
    prof = prof or {}
    nan = float("nan")
    ms = res["ms"]
    row = dict(name=name, block=0, p50_ms=harness.percentile(ms["frame"], 50), p95_ms=harness.percentile(ms["frame"], 95),
               peak_mib=harness.peak_mib(), kernels_per_chunk=prof.get("kernels", nan),
               launches_per_chunk=prof.get("launches", nan), busy_ms=prof.get("busy_ms", nan), warmup_s=warm,
               sha256=res["sha256"], sha256_tokens=res["sha256_tokens"], sha256_pcm=res["sha256_pcm"],
               first_tokens=res["first_tokens"], frames=len(ms["frame"]), notes=notes, ms=ms["frame"],
               frame_tokens=res["frame_tokens"], tokens_shape=res["tokens_shape"], frame_pcm=res["frame_pcm"],
               kernel_names=prof.get("kernel_names"), stage_gaps=prof.get("stage_gaps"), digests=res.get("digests"),
               **extra)
    for stage in STAGES:
        row[f"{stage}_p50_ms"] = harness.percentile(ms[stage], 50)
        row[f"{stage}_p95_ms"] = harness.percentile(ms[stage], 95)
    return row


# --------------------------------------------------------------------------- cells
def run_stock_cell(args, name: str) -> list[dict]:
    """B0 (eager), B0b (B0 again, in a process of its own: is the stock stream reproducible?) or vendor
    (moshi's CUDAGraphed as shipped): the upstream objects keep their state."""
    eager = name != "vendor"
    if eager:
        os.environ["NO_CUDA_GRAPH"] = "1"  # what the issue measured as eager; upstream_eager also disables it
    pin_envelope()
    env = describe_envelope()
    device = pick_device()
    mo, up, cfg, steps = build(args, device)
    pcm = mo.user_audio(args.frames + 1, seed=AUDIO_SEED, device=device)
    for stage in STAGES:
        mo.install_state(getattr(steps, stage), getattr(steps, stage).initial_state())
    mimi, gen = steps.decode.module, steps.lm.gen
    b = cfg.batch_size
    graphed = not eager and device == "cuda"
    stages = {"encode": mimi.encode, "lm": lambda c: steps.lm.as_tokens(gen.step(c), b, device),
              "decode": mimi.decode}
    # what the optimized cells cannot expose (logits) is kept for the eager cells: B0 vs B0b then says
    # whether the stock eager stream itself is reproducible up to its logits
    stash = stash_logits(gen) if eager else None
    probe = lm_probe(steps.lm, lambda: {s.name: s.get() for s in steps.lm.slots}, kv_full_every=args.kv_full_every,
                     stash=stash)
    extra: dict = {}
    if name == "B0":
        extra.update(envelope={k: str(v) for k, v in env.items()}, gpu=torch.cuda.get_device_name() if device == "cuda"
                     else "cpu", torch=torch.__version__, moshi=up.version)
    _ready(device, args, name)
    _record(args, device)
    with mo.upstream_eager(up, cuda_graph=graphed):
        res = stream(stages, pcm[:-1], steps.max_delay, device, probe)
        _write_peak(args, device, name)
        prof = _profile(stages, pcm[-1])
    notes = "CUDAGraphed as shipped (captured on the 2nd call)" if graphed else "eager (NO_CUDA_GRAPH=1)"
    if name == "B0b":
        notes += ", B0 again in its own process"
    first = res["ms"]["frame"][:3]
    return [_row(name, res, prof, 0.0, notes, lane=args.lane, first_frames_ms=first, **extra)]


def _record(args, device: str) -> None:
    """``--memory-peak``: record allocations from the moment the cell is ready (the peak's start)."""
    if args.memory_peak and device == "cuda":
        harness.record_memory()


def _write_peak(args, device: str, name: str) -> None:
    """``--memory-peak``: what was live at the cell's peak (warm-up, captures and the stream), by where
    it was allocated; before the profiled frame, which is not part of the peak."""
    if args.memory_peak and device == "cuda":
        harness.write_memory_peak(args.memory_peak, name)


def run_opt_cell(args, name: str) -> list[dict]:
    """S, R, SR, Snh: the exported steps through cadence_fx.optimize."""
    import cadence_fx as cf
    from cadence_fx.adapters.streaming import export_step_catalog

    pin_envelope()
    spec = OPT_CELLS[name]
    device = pick_device()
    warnings = harness.library_warnings()  # a refused capture's error, kept in the row
    mo, up, cfg, steps = build(args, device)
    pcm = mo.user_audio(args.frames + 1, seed=AUDIO_SEED, device=device)
    examples = steps.examples()
    contracts = {s: mo.moshi_contract(getattr(steps, s)) for s in STAGES}
    if spec.get("mimi_hoist") is False:
        contracts.update({s: mo.moshi_contract(getattr(steps, s), hoist_constants=False, fold_weights=False)
                          for s in ("encode", "decode")})
    export_s, optimize_s, progs = {}, {}, {}
    # the three programs run one after the other on one stream: one backend for them all, so their
    # captures share one stream and its cuBLAS workspace, as moshi's own graphs share torch's
    replay = mo.shared_replay(device, branches=spec.get("branches", 1)) if spec["replay"] == "auto" else spec["replay"]
    for s in STAGES:
        step = getattr(steps, s)
        t0 = time.perf_counter()
        eps = export_step_catalog(step, step.initial_state(), [{"x": examples[s]}], contracts[s])
        export_s[s] = time.perf_counter() - t0
        t0 = time.perf_counter()
        progs[s] = (_Exported(eps) if spec.get("exported") else
                    cf.optimize(eps, contracts[s], replay=replay, state=spec["state"],
                                transactional=spec.get("transactional", True)))
        optimize_s[s] = time.perf_counter() - t0
        del eps
        print(f"[{name}] {s}: export {export_s[s]:.1f} s, optimize {optimize_s[s]:.1f} s", file=sys.stderr, flush=True)
    # the initial state: regions from the host (the program copies them into its buffers on the first
    # call), plain inputs on the device; then the upstream objects' own copy of the state can go
    state = {s: _initial(getattr(steps, s), contracts[s], spec["state"], device) for s in STAGES}
    released = sum(getattr(steps, s).release_state() for s in STAGES)
    _ready(device, args, name)
    _record(args, device)
    t0 = time.perf_counter()
    for s in STAGES:
        # region inputs are views of the program's buffers in warm-up; other inputs are zeros it makes
        progs[s].warmup(examples[s])
    warm = time.perf_counter() - t0
    gc.collect()
    st = {s: dict(v) for s, v in state.items()}

    def stage(s: str) -> Callable[[torch.Tensor], torch.Tensor]:
        step = getattr(steps, s)

        def call(x: torch.Tensor) -> torch.Tensor:
            out = progs[s](*step.next_args({"x": x}, st[s]))
            st[s] = step.carry(out)
            return out[0]
        return call

    stages = {s: stage(s) for s in STAGES}
    before = {s: progs[s].counters() for s in STAGES}
    lm_step = steps.lm
    probe = lm_probe(lm_step, lambda: {lm_step.slot_of(n).name: t for n, t in st["lm"].items()},
                     kv_full_every=args.kv_full_every)
    res = stream(stages, pcm[:-1], steps.max_delay, device, probe)
    _write_peak(args, device, name)
    counters = {s: _delta(before[s], progs[s].counters()) for s in STAGES}
    prof = _profile(stages, pcm[-1])
    state_info = {s: ({} if spec.get("exported") else _state_info(progs[s], contracts[s], spec["state"]))
                  for s in STAGES}
    notes = ", ".join(f"{s}: replays {c['replays']}, eager {c['eager']}" + (f" {c['rejections']}" if c["rejections"]
                                                                             else "") for s, c in counters.items())
    branches = {s: b for s in STAGES if (b := harness.branch_summary([progs[s]])) is not None} \
        if not spec.get("exported") else {}
    return [_row(name, res, prof, warm, notes, lane=args.lane, export_s=export_s, optimize_s=optimize_s,
                 branches=branches or None, library_warnings=warnings,
                 counters=counters, state=state_info, released_stock_state_mib=released / 2**20,
                 memory={s: {k: v / 2**20 for k, v in progs[s].memory_census().items()} for s in STAGES})]


class _Exported:
    """The exported programs of one step run as torch.export gives them (cell ``E``): the one program
    whose signature matches the call, through ``ep.module()``; the optimized program's accessors the cell
    reads, with nothing to report."""

    def __init__(self, eps) -> None:
        self.modules = {}
        for ep in eps:
            metas = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"
                     and n.name in ep.graph_signature.user_inputs]
            self.modules[tuple((tuple(m.shape), m.dtype) for m in metas)] = ep.module()

    def __call__(self, *args):
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        return self.modules[key](*args)

    def warmup(self, *_args) -> dict:
        return {"seconds": 0.0}

    def counters(self) -> dict:
        return {"replays": 0, "eager": 0, "rejections": {}}

    def memory_census(self) -> dict:
        return {}


def _initial(step, contract, regions_on_host: bool, device: str) -> dict[str, torch.Tensor]:
    """The step's initial state: region inputs on the host when the program copies them in (the state
    rule), everything else on the device."""
    regions = {r.input for r in contract.regions} if regions_on_host else set()
    host = step.initial_state("cpu")
    return {n: t if n in regions else t.to(device) for n, t in host.items()}


def _delta(before: dict, after: dict) -> dict:
    rej = {k: v - before["rejections"].get(k, 0) for k, v in after["rejections"].items()
           if v - before["rejections"].get(k, 0)}
    return {"replays": after["replays"] - before["replays"], "eager": after["eager"] - before["eager"],
            "rejections": rej}


def _state_info(prog, contract, state_rule: bool) -> dict:
    """What the program owns as state, how the stream fed it, and (where ``cadence_fx.plan`` counts it)
    the state bytes one call writes, stock program vs rewritten one."""
    out: dict[str, Any] = {"regions": 0}
    if state_rule:
        stats = prog.stats
        out = {"regions": len(contract.regions),
               "region_mib": sum(rp.stored_bytes for rp in prog.plan.regions) / 2**20,
               # regions whose outgoing value is written whole into the buffer every call (the rest are
               # written in place by the model: ring positions, counters)
               "regions_written_whole_per_call": stats["passes"].get("retention_in_place", 0),
               "state_in_place": stats["state_in_place"], "state_adopted": stats["state_adopted"]}
    try:
        from cadence_fx.plan import state_traffic
    except ImportError:  # an older cadence_fx without the count
        return out
    for cls in state_traffic(prog):
        counts = {k: [v.get(k, 0) for v in cls["regions"].values()] for k in ("stock", "optimized")}
        # a region whose count is unknown (None) makes the total unknown, not smaller
        out["state_bytes_per_call"] = {k: None if None in c else sum(c) for k, c in counts.items()}
        out["left_stock"] = [str(f) for f in cls["left_stock"]]  # the sentences (records: cadence_fx.annotations)
    return out


# --------------------------------------------------------------------------- driver
ROW_FIELDS = ("name", "run", "block", "lane", "p50_ms", "p95_ms", "encode_p50_ms", "encode_p95_ms", "lm_p50_ms",
              "lm_p95_ms", "decode_p50_ms", "decode_p95_ms", "peak_mib", "kernels_per_chunk", "launches_per_chunk",
              "busy_ms", "warmup_s", "sha256", "sha256_tokens", "sha256_pcm", "first_tokens", "divergence",
              "digest_divergence", "kernel_diff", "kernel_names", "stage_gaps",
              "bitexact", "speedup", "frames", "notes", "ms", "error", "export_s", "optimize_s", "counters", "state",
              "released_stock_state_mib", "memory", "branches", "library_warnings", "first_frames_ms", "envelope", "gpu", "torch", "moshi")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1000, help="frames per cell (80 ms each)")
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (CPU smoke run)")
    ap.add_argument("--kv-full-every", type=int, default=KV_FULL_EVERY,
                    help="frames between digests of every written LM KV position (0: never; see lm_probe)")
    ap.add_argument("--memory-peak", default=None,
                    help="append what was live at each cell's device peak, grouped by where it was allocated")
    ap.add_argument("--memory-ready", default=None,
                    help="record allocations from each cell's start and append what is live when the cell is "
                         "ready (built, exported, optimized: where its peak is counted from)")
    harness.add_flags(ap, cells="B0,vendor,S,R,SR", blocks=1)
    args = ap.parse_args()
    if args.one:
        if args.memory_ready and torch.cuda.is_available():
            harness.record_memory()  # before the model is built: every block live at the ready point has a stack
        cell = run_stock_cell if args.one in STOCK_CELLS else run_opt_cell
        harness.write_cell(args.out, cell(args, args.one))
        return
    common = ["--frames", str(args.frames), "--kv-full-every", str(args.kv_full_every)] + (
        ["--reduced"] if args.reduced else []) + (["--memory-peak", args.memory_peak] if args.memory_peak else []) + (
        ["--memory-ready", args.memory_ready] if args.memory_ready else [])
    report(harness.collect(args, __file__, common, per_block=False), args)


def report(cells: list[dict], args) -> None:
    """Print the table, the per-stage medians and the targets; save the JSON report."""
    nan = float("nan")
    base = next((r for r in cells if r["name"] == harness.BASELINE and "error" not in r), {})
    gpu = base.get("gpu") or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print(f"Moshi {'reduced' if args.reduced else 'released'} sizes, {args.frames} frames per cell, {gpu}, "
          f"torch {base.get('torch', torch.__version__)}, moshi {base.get('moshi', '?')}, {date.today()}")
    print(harness.table(cells))
    print(f"{'cell':<10}{'LM p50':>9}{'LM p95':>9}{'enc p50':>9}{'dec p50':>9}  tokens / pcm sha256")
    for r in cells:
        if "error" not in r:
            print(f"{r['name']:<10}{r['lm_p50_ms']:>9.2f}{r['lm_p95_ms']:>9.2f}{r['encode_p50_ms']:>9.2f}"
                  f"{r['decode_p50_ms']:>9.2f}  {r['sha256_tokens'][:12]} / {r['sha256_pcm'][:12]}")
    for r in cells:
        for stage, g in ((r.get("stage_gaps") or {}) if "error" not in r else {}).items():
            print(f"{r['name']:<10}{stage:<8} profiled: wall {g['wall_ms']:.2f} ms = lead {g.get('lead_ms', nan):.2f} "
                  f"+ span {g.get('span_ms', nan):.2f} (node switches {g.get('short_gaps_ms', nan):.2f}, host waits "
                  f"{g.get('host_gaps_ms', nan):.2f}) + tail")
    for r in cells:
        for line in (r.get("library_warnings") or [])[:3]:  # a refused capture says why here
            print(f"{r['name']:<10}cadence_fx: {line[:300]}")
    for r in cells:
        if "error" not in r and r["name"] != harness.BASELINE:
            r["divergence"] = divergence(r, base)
            print(f"{r['name']:<10}vs {harness.BASELINE}: {describe(r['divergence'])}")
            r["digest_divergence"] = digest_divergence(r, base)
            print(f"{'':<10}first frame each digest differs (= identical): {describe_digests(r['digest_divergence'])}")
            r["kernel_diff"] = kernel_diff(r, base)
            if r["kernel_diff"]:
                print(f"{'':<10}kernels per profiled frame vs {harness.BASELINE} ({len(r['kernel_names'])} distinct "
                      f"names vs {len(base['kernel_names'])}; difference (cell vs {harness.BASELINE}) name):")
                print("\n".join(f"{'':<12}{line}" for line in kernel_lines(r, base, r["kernel_diff"])))
    targets = _targets(cells)
    print("targets:", json.dumps(targets, indent=1))
    if args.json:
        harness.write_json(args.json, dict(gpu=gpu, torch=base.get("torch"), moshi=base.get("moshi"),
                                           date=str(date.today()), frames=args.frames, envelope=base.get("envelope"),
                                           cells=[{k: r[k] for k in ROW_FIELDS if k in r} for r in cells],
                                           summary=harness.summarize(cells), targets=targets))


def divergence(row: dict, base: dict) -> dict | None:
    """Where ``row``'s stream parts from ``base``'s: the first frame whose tokens differ and which entries
    (``text`` or ``audio K``, with the batch index when there is more than one stream), how many frames'
    tokens differ, and the first frame whose PCM differs. ``None`` where either row has no per-frame record
    (rows of an older benchmark)."""
    if not base or "frame_tokens" not in row or "frame_tokens" not in base:
        return None
    b, per = base.get("tokens_shape") or [1, len(base["frame_tokens"][0])]
    rt, bt = row["frame_tokens"], base["frame_tokens"]
    differ = [k for k, (x, y) in enumerate(zip(rt, bt)) if x != y]
    out: dict[str, Any] = {"frames": min(len(rt), len(bt)), "token_frames_differ": len(differ),
                           "first_token_frame": differ[0] if differ else None, "first_token_entries": None}
    if differ:
        x, y = rt[differ[0]], bt[differ[0]]
        out["first_token_entries"] = [("text" if i % per == 0 else f"audio {i % per - 1}")
                                      + (f" (stream {i // per})" if b > 1 else "")
                                      for i in range(len(x)) if x[i] != y[i]]
    rp, bp = row.get("frame_pcm") or [], base.get("frame_pcm") or []
    pcm = [k for k, (x, y) in enumerate(zip(rp, bp)) if x != y]
    out["first_pcm_frame"] = pcm[0] if pcm else None
    out["pcm_frames_differ"] = len(pcm)
    # PCM that parts before the tokens do (or with equal tokens) is Mimi's decode itself, not the LM
    out["pcm_before_tokens"] = bool(pcm) and (not differ or pcm[0] < differ[0])
    return out


# the per-frame digests in the order the data flows through a frame
DIGEST_KEYS = ("codes", "kv", "text_logits", "dep_input", "dep_logits", "sampled", "ring", "counters", "kv_full")


def digest_divergence(row: dict, base: dict) -> dict | None:
    """Per digest of :func:`stream` / :func:`lm_probe`: the frames both rows recorded (``compared``), the first
    frame where they differ (``first``, ``None``: identical) and how many differ; for ``kv`` the layers whose
    entries differ at that frame, for ``dep_logits`` the codebooks, for ``sampled`` the entries. A digest
    either row lacks (logits of an optimized cell) is ``None``."""
    a, b = row.get("digests"), (base or {}).get("digests")
    if not a or not b:
        return None
    streams, per = base.get("tokens_shape") or [1, None]
    out: dict[str, Any] = {}
    for key in DIGEST_KEYS:
        x, y = a.get(key), b.get(key)
        if not x or not y or all(v is None for v in x) or all(v is None for v in y):
            out[key] = None
            continue
        both = [k for k, (u, v) in enumerate(zip(x, y)) if u is not None and v is not None]
        differ = [k for k in both if x[k] != y[k]]
        e: dict[str, Any] = {"compared": len(both), "first": differ[0] if differ else None, "differ": len(differ)}
        if differ:
            f = differ[0]
            if key == "kv":
                la, lb = a["kv_layers"][f], b["kv_layers"][f]
                e["layers"] = [i for i, (u, v) in enumerate(zip(la, lb)) if u != v]
            elif key == "dep_logits":
                e["codebooks"] = [i for i, (u, v) in enumerate(zip(x[f], y[f])) if u != v]
            elif key == "sampled":
                n = per or len(x[f])
                e["entries"] = [("text" if i % n == 0 else f"audio {i % n - 1}") + (f" (stream {i // n})" if
                                                                                  streams > 1 else "")
                                for i, (u, v) in enumerate(zip(x[f], y[f])) if u != v]
        out[key] = e
    return out


def describe_digests(d: dict | None) -> str:
    if d is None:
        return "no digests"
    parts = []
    for key, e in d.items():
        if e is None:
            parts.append(f"{key} n/a")
        elif e["first"] is None:
            parts.append(f"{key} = ({e['compared']})")
        else:
            where = (f" layers {e['layers'][:8]}{'...' if len(e['layers']) > 8 else ''} of this frame" if "layers" in e
                     else f" codebooks {e['codebooks']}" if "codebooks" in e
                     else f" ({', '.join(e['entries'])})" if "entries" in e else "")
            parts.append(f"{key} {e['first']}{where} [{e['differ']}/{e['compared']}]")
    return "; ".join(parts)


def describe(d: dict | None) -> str:
    if d is None:
        return "no per-frame record"
    if d["first_token_frame"] is None and d["first_pcm_frame"] is None:
        return f"identical over {d['frames']} frames"
    tok = ("tokens identical" if d["first_token_frame"] is None else
           f"tokens first differ at frame {d['first_token_frame']} ({', '.join(d['first_token_entries'])}), "
           f"{d['token_frames_differ']} frames differ")
    pcm = ("PCM identical" if d["first_pcm_frame"] is None else
           f"PCM first differs at frame {d['first_pcm_frame']} ({d['pcm_frames_differ']} frames)")
    return f"{tok}; {pcm}" + (" [PCM parts first: Mimi decode]" if d["pcm_before_tokens"] else "")


def _targets(cells: list[dict]) -> dict:
    """The issue's targets: SR reaches >= 95 % of the vendor's speedup over B0 (per frame, p50), peak
    memory at most the vendor's, and tokens / codes / PCM bit-identical with B0."""
    by = {r["name"]: r for r in cells if "error" not in r}
    out: dict[str, Any] = {}
    if {"B0", "vendor", "SR"} <= set(by):
        b0, v, sr = by["B0"], by["vendor"], by["SR"]
        out["vendor_speedup"] = b0["p50_ms"] / v["p50_ms"]
        out["SR_speedup"] = b0["p50_ms"] / sr["p50_ms"] if sr["bitexact"] else None
        out["SR_of_vendor_speedup"] = out["SR_speedup"] / out["vendor_speedup"] if out["SR_speedup"] else None
        out["SR_speedup_ok"] = bool(out["SR_of_vendor_speedup"] and out["SR_of_vendor_speedup"] >= 0.95)
        if v.get("peak_mib") and sr.get("peak_mib"):
            out["SR_peak_mib"], out["vendor_peak_mib"] = sr["peak_mib"], v["peak_mib"]
            out["SR_peak_ok"] = sr["peak_mib"] <= v["peak_mib"]
    out["bitexact"] = {name: r["bitexact"] for name, r in by.items()}
    return out


if __name__ == "__main__":
    main()
