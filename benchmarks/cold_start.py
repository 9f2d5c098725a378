"""Cold start of Token2Wav: export + optimize once, save; then a fresh process loads, captures and streams.

    python benchmarks/cold_start.py                        # released sizes on the GPU (scripts/gpu.sh cold)
    python benchmarks/cold_start.py --reduced --chunks 3   # small, on the CPU
    python benchmarks/cold_start.py --lanes 8              # a worker of 8 lanes (scripts/gpu.sh cold --lanes 8)

This process builds the stock step (random weights), exports the catalog, optimizes it, saves the
artifact, and streams ``--chunks`` chunks through the freshly optimized program (captured first) to
get the reference SHA-256 of the PCM. A second Python process (``--child``) then starts from nothing:
it imports torch and cadence_fx (not the upstream model code: it drives the stream from the step's
input names alone), loads the artifact, captures the catalog, and streams the same chunks. Printed:
one JSON row with export, optimize, save, load (read / digest check / placement / rebuild), capture
and first-chunk seconds, the child's time to first chunk (from its interpreter start and from
``cf.load``), the artifact's size, and whether the child's stream SHA-256 equals the fresh program's.
With ``--lanes L`` the child loads L lanes and captures all of them before its first chunk (the time
to first chunk is then an L-lane worker's time to serve; ``lane_capture_s`` splits the capture by
lane), and after the default stream one session per lane streams the same chunks at once, each
gated by SHA-256 against the fresh program's (``lanes_replayed`` says which lanes served them).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the child's clock starts before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _stream(prog, names, state_out, state, fresh, seed: int) -> tuple[list, list[float]]:
    """Feed ``fresh`` through ``prog`` from ``state``; the state inputs are fed from the outputs
    ``state_out`` names. Returns the PCM chunks (output 0) and seconds per chunk."""
    import torch

    torch.manual_seed(seed)  # HiFT draws random numbers: both processes draw the same ones
    st = {k: v.clone() for k, v in state.items()}
    pcm, secs = [], []
    for f in fresh:
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = prog(*[{**f, **st}[n] for n in names])
            chunk = out[0].to("cpu", copy=True)  # the first chunk counts once its PCM is on the host
        secs.append(time.perf_counter() - t0)
        pcm.append(chunk)
        st = {name: out[i] for name, i in state_out.items()}
    return pcm, secs


def _phases(warm: dict) -> dict[str, float]:
    """Warm-up's capture seconds summed by phase over every class (``ClassReport.phase_seconds``)."""
    total: dict[str, float] = {}
    for classes in warm["classes"].values():
        for report in classes.values():
            for phase, sec in report.phase_seconds.items():
                total[phase] = total.get(phase, 0.0) + sec
    return total


def child(args: argparse.Namespace) -> None:
    """The restarted server: load, capture, stream; prints one JSON line."""
    import torch

    import cadence_fx as cf
    from cadence_fx.determinism import pin_envelope, sha256_tensors

    t_import = time.perf_counter()
    pin_envelope()
    t_envelope = time.perf_counter()
    # the harness's inputs and expected bytes, read to the host: not a server's cost, and no device yet
    io = torch.load(args.inputs, map_location="cpu", weights_only=True)
    t_load0 = time.perf_counter()
    # load starts the device itself (its context) while it decodes the graphs: load_report has both
    prog = cf.load(args.artifact, lanes=args.lanes)
    t_loaded = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    io["state"] = {n: t.to(device) for n, t in io["state"].items()}
    io["fresh"] = [{n: t.to(device) for n, t in f.items()} for f in io["fresh"]]
    t_device = time.perf_counter()  # the inputs on the device (the harness's, as above)
    full_lanes = None if args.full_lanes in (None, "all") else int(args.full_lanes)
    warm = prog.warmup(*[{**io["fresh"][0], **io["state"]}[n] for n in io["names"]], full_lanes=full_lanes)
    _sync()
    t_captured = time.perf_counter()
    pcm, secs = _stream(prog, io["names"], io["state_out"], io["state"], io["fresh"], io["seed"])
    t_first = t_captured + secs[0]
    lanes = _lanes_exact(prog, io) if args.lanes > 1 else {}
    blocked = sorted(m for m in sys.modules if m.startswith(("stepaudio2", "cadence_fx.adapters")))
    print("CHILD " + json.dumps({
        "import_s": t_import - T_START, "device_init_s": prog.load_report["device_init_s"],
        "envelope_s": t_envelope - t_import, "inputs_read_s": t_load0 - t_envelope,
        "inputs_to_device_s": t_device - t_loaded,  # the first copies to the device after load
        "inputs_s": (t_load0 - t_import) + (t_device - t_loaded),
        "load_s": t_loaded - t_load0, "load": prog.load_report,
        "capture_s": t_captured - t_device, "warmup_s": warm["seconds"], "capture_phases_s": _phases(warm),
        "first_chunk_s": secs[0],
        "ttfc_from_start_s": t_first - T_START, "ttfc_from_load_s": t_first - t_load0,
        # less reading the harness's inputs file only: a server moves its own inputs to the device too
        "ttfc_server_s": t_first - T_START - (t_load0 - t_envelope),
        "chunk_ms": [s * 1e3 for s in secs], "sha256": sha256_tensors(pcm),
        "modules_from_model_code": blocked, "counters": prog.counters(), "lanes": args.lanes,
        "lane_capture_s": _lane_capture_seconds(warm), "lane_phases_s": _lane_phases(warm),
        "full_lanes": full_lanes, **lanes,
    }), flush=True)


def _lane_capture_seconds(warm: dict) -> dict[str, float]:
    """Warm-up's capture seconds by lane (the engines of lanes after the first are named ``laneK/...``)."""
    out: dict[str, float] = {}
    for name, classes in warm["classes"].items():
        lane = name.split("/", 1)[0] if name.startswith("lane") else "lane0"
        out[lane] = out.get(lane, 0.0) + sum(r.capture_seconds for r in classes.values())
    return out


def _lane_phases(warm: dict) -> dict[str, dict[str, float]]:
    """Warm-up's capture seconds by lane and phase (probe, staging and eager warm-up, capture), and the
    classes each lane captured: where a lane's capture time goes."""
    out: dict[str, dict[str, float]] = {}
    for name, classes in warm["classes"].items():
        lane = out.setdefault(name.split("/", 1)[0] if name.startswith("lane") else "lane0", {"graphs": 0})
        for report in classes.values():
            lane["graphs"] += 1
            for phase, sec in report.phase_seconds.items():
                lane[phase] = lane.get(phase, 0.0) + sec
    return out


def _lanes_exact(prog, io: dict) -> dict:
    """One session per lane, streamed at once from threads (each takes a free lane): every session's
    PCM must be the default stream's bytes; which lanes replayed is read from their counters."""
    import threading

    from cadence_fx.determinism import sha256_tensors

    n = len(prog.lanes.lanes)
    sessions = [prog.session(f"lane-check-{i}", seed=io["seed"]) for i in range(n)]
    digests: list[str | None] = [None] * n
    errors: list[str] = []
    before = [lane.runners.counters()["replays"] for lane in prog.lanes.lanes]

    def run(i: int) -> None:
        try:
            st = {k: v.clone() for k, v in io["state"].items()}
            pcm = []
            for f in io["fresh"]:
                out = sessions[i](*[{**f, **st}[name] for name in io["names"]])
                pcm.append(out[0].to("cpu", copy=True))
                st = {name: out[j] for name, j in io["state_out"].items()}
            digests[i] = sha256_tensors(pcm)
        except Exception as e:  # reported in the row: the bench's verdict, not a crash
            errors.append(f"session {i}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used = [i for i, lane in enumerate(prog.lanes.lanes) if lane.runners.counters()["replays"] > before[i]]
    for s in sessions:
        s.close()
    return {"session_sha256": digests, "session_errors": errors, "lanes_replayed": used}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=4, help="chunks streamed by each process")
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (CPU)")
    ap.add_argument("--full-lanes", default=None,
                    help="with --lanes: only this many lanes capture every catalog class, the others the steady "
                         "(last) one (warmup(full_lanes=...)); a comma list runs one restarted process per "
                         "setting, 'all' for every lane every class (the default)")
    ap.add_argument("--lanes", type=int, default=1,
                    help="lanes of the loaded program (every lane captured before the first chunk; with more "
                         "than one, a session per lane then streams the same chunks, each gated by SHA-256)")
    ap.add_argument("--dir", default=None, help="where the artifact goes (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the row here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0

    import torch

    import cadence_fx as cf
    from cadence_fx.adapters import token2wav as t2w
    from cadence_fx.adapters.stepaudio2 import load_stepaudio2
    from cadence_fx.determinism import describe_envelope, pin_envelope, sha256_tensors

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pin_envelope()
    up = load_stepaudio2(Path(os.environ.get("CADENCE_FX_UPSTREAM", ROOT / ".upstream")) / "minicpmo-0.1.2")
    cfg = t2w.Token2WavConfig.reduced() if args.reduced else t2w.Token2WavConfig()
    torch.manual_seed(cfg.seed)
    step = t2w.Token2WavStep(t2w.build_flow(up, cfg), t2w.build_vocoder(up, cfg), cfg, driver="0.1.2")
    step = step.to(device).eval()
    prompt_tokens, prompt_mel, spk = (t.to(device) for t in t2w.example_prompt(cfg))
    state = step.setup(prompt_tokens, prompt_mel, spk)
    contract = t2w.token2wav_contract(cfg, "chunk", driver="0.1.2")
    row: dict = {"bench": "cold_start", "device": describe_envelope()["device"], "torch": torch.__version__,
                 "sizes": "reduced" if args.reduced else "released", "chunks": args.chunks}

    t0 = time.perf_counter()
    eps = t2w.export_step_catalog(step, state, step.fresh(3, spk, seed=99), contract, granularity="chunk")
    row["export_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    prog = cf.optimize(eps, contract)
    _sync()
    row["optimize_s"] = time.perf_counter() - t0
    del eps  # the optimized program holds what it needs

    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cadence_fx_cold_"))
    folder.mkdir(parents=True, exist_ok=True)
    artifact = folder / "token2wav.cfx"
    info = cf.save(prog, artifact)  # before any call: the program exactly as optimize left it
    row.update(save_s=info["seconds"], artifact_bytes=info["bytes"], artifact_tensor_bytes=info["tensor_bytes"],
               artifact_tensors=info["tensors"])

    fresh = step.fresh(args.chunks, spk, seed=1)
    names = list(step.inputs)
    example = [{**fresh[0], **state}[n] for n in names]
    warm = prog.warmup(*example)
    row["fresh_capture_s"] = warm["seconds"]
    row["fresh_capture_phases_s"] = _phases(warm)
    pcm, secs = _stream(prog, names, dict(step.state), state, fresh, seed=7)
    row["fresh_sha256"] = sha256_tensors(pcm)
    row["fresh_chunk_ms"] = [s * 1e3 for s in secs]
    inputs = folder / "inputs.pt"
    torch.save({"names": names, "state_out": dict(step.state), "seed": 7,
                "state": {k: v.detach() for k, v in state.items()},
                "fresh": [{k: v for k, v in f.items()} for f in fresh]}, inputs)

    # the restarted server: a fresh interpreter, timed from its start (one per --full-lanes setting; the
    # first one's figures are the row's loaded_*, every one's in runs)
    row["runs"] = []
    for setting in (args.full_lanes or "all").split(","):
        full = [] if setting == "all" else ["--full-lanes", setting]
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--artifact", str(artifact),
                              "--inputs", str(inputs), "--lanes", str(args.lanes), *full], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("CHILD ")]
        if run.returncode != 0 or not lines:
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            row["runs"].append(dict(full_lanes=setting, error=f"child exited {run.returncode}"))
            continue
        got = json.loads(lines[-1][len("CHILD "):])
        exact = got["sha256"] == row["fresh_sha256"] and not got.get("session_errors") and all(
            d == row["fresh_sha256"] for d in got.get("session_sha256", []))
        row["runs"].append({**got, "full_lanes": setting, "child_wall_s": wall, "bit_exact": exact})
        print(f"[cold] full_lanes={setting}: first chunk {got['ttfc_from_start_s']:.1f} s from start (load "
              f"{got['load_s']:.1f} s, capture {got['capture_s']:.1f} s), exact {exact}", file=sys.stderr, flush=True)
    first = row["runs"][0]
    if "error" in first:
        row["error"] = first["error"]
    else:
        row["child_wall_s"] = first["child_wall_s"]
        row.update({f"loaded_{k}": v for k, v in first.items() if k not in ("full_lanes", "child_wall_s", "bit_exact")})
    row["bit_exact"] = all(r.get("bit_exact") for r in row["runs"])
    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    if not args.dir:
        for p in (artifact, inputs):
            p.unlink(missing_ok=True)
        folder.rmdir()
    return 0 if row.get("bit_exact") else 1


if __name__ == "__main__":
    sys.exit(main())
