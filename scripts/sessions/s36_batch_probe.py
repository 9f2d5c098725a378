"""Session 36: can conversations share one batched step and stay exact?

Every capacity row so far runs each conversation's step on its own (lanes of CUDA graphs, worker
processes under MPS); at capacity the GPU is busy with small kernels, ~5 at once. Batching B
conversations into one step (what moshi's own ``exec_mask`` is for) turns B small GEMMs into one.
It is a lever only if row i of the batched step is bitwise what conversation i's solo step gives:
per-session exactness against the stock solo run is the invariant. This probe measures that on the
released models (random weights), on this GPU:

- Moshi's LM (7B, bf16, ``LMGen`` greedy so tokens depend on logits only): per frame, the temporal
  transformer's output, the text logits and the tokens of each batch row against its solo run;
- Token2Wav's DiT estimator (16 x 512, CFG batch 2 per conversation; fp32, and fp16 under autocast as
  the driver's float16 switch runs it): the velocity and both caches per chunk;
- the GEMMs under both: ``F.linear`` rows of a batch of M against the same rows alone.

Writes $OUT/batch_probe.json; prints one line per comparison.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cadence_fx.determinism import pin_envelope

OUT = Path(os.environ.get("OUT", ".out"))
UP = Path(os.environ.get("CADENCE_FX_UPSTREAM", ".upstream"))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "2,4,8").split(",")]
FRAMES = int(os.environ.get("FRAMES", "12"))
CHUNKS = int(os.environ.get("CHUNKS", "4"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
REDUCED = DEV == "cpu"  # a CPU run (the script's own check) takes the reduced configurations
results: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__, "envelope": pin_envelope()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


def gemm_rows() -> None:
    """Rows of one GEMM of M rows against each row's own GEMM (M=1), and against a GEMM of the
    conversation's own rows (the solo step's M)."""
    out = []
    cases = [("moshi-lm-bf16", torch.bfloat16, 4096, 4096, 1), ("fp32-m1", torch.float32, 4096, 4096, 1), ("moshi-ffn-bf16", torch.bfloat16, 4096, 11264, 1),
             ("dit-fp32", torch.float32, 512, 1536, 2 * 25), ("dit-fp16", torch.float16, 512, 1536, 2 * 25)]
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, dtype, k, n, solo in cases:
        w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) / k ** 0.5
        for b in [1] + BATCHES + [16]:
            x = torch.randn(b * solo, k, device=DEV, dtype=dtype, generator=g)
            batched = F.linear(x, w)
            rows = [F.linear(x[i * solo:(i + 1) * solo], w) for i in range(b)]
            ok = all(same(batched[i * solo:(i + 1) * solo], r) for i, r in enumerate(rows))
            out.append({"case": name, "B": b, "rows_per_conversation": solo, "exact": ok})
            log(f"gemm {name} B={b} (M {b * solo} against {solo}): {'exact' if ok else 'DIFFERS'}")
    results["gemm"] = out


def moshi() -> None:
    from cadence_fx.adapters import moshi as mo
    from cadence_fx.adapters.moshi.build import build_lm, build_lm_gen
    from cadence_fx.adapters.moshi.steps import upstream_eager

    up = mo.load_moshi()
    cfg = mo.MoshiConfig.reduced(use_sampling=False) if REDUCED else mo.MoshiConfig(use_sampling=False)
    t0 = time.perf_counter()
    lm = build_lm(up, cfg, DEV)
    gen = build_lm_gen(up, cfg, lm)
    gen.support_out_of_sync = True
    log(f"moshi LM built in {time.perf_counter() - t0:.1f} s")
    n_conv = max(BATCHES)
    g = torch.Generator().manual_seed(7)
    needed = lm.num_codebooks - lm.dep_q - 1
    codes = torch.randint(0, lm.card, (n_conv, needed, FRAMES), generator=g).to(DEV)
    logits: list = []
    gen.on_text_logits_hook = lambda t: logits.append(t.clone())

    def run(batch: slice) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        frames = []
        b = batch.stop - batch.start
        with upstream_eager(up), torch.no_grad(), gen.streaming(b):
            for f in range(FRAMES):
                logits.clear()
                tokens, tout = gen._step(codes[batch, :, f:f + 1])
                frames.append((tout.clone(), logits[0], tokens.clone()))
        sync()
        return frames

    solo = [run(slice(i, i + 1)) for i in range(n_conv)]
    again = run(slice(0, 1))  # is the solo run itself repeatable?
    rep = all(same(a, b) for fa, fb in zip(solo[0], again) for a, b in zip(fa, fb))
    log(f"moshi solo run repeated: {'exact' if rep else 'DIFFERS'}")
    out = {"solo_repeatable": rep, "frames": FRAMES, "batches": []}
    for b in BATCHES:
        batched = run(slice(0, b))
        first = {}
        for part, name in enumerate(("transformer_out", "text_logits", "tokens")):
            bad = [(i, f) for i in range(b) for f in range(FRAMES)
                   if not same(batched[f][part][i:i + 1], solo[i][f][part])]
            first[name] = {"rows_frames_differing": len(bad), "of": b * FRAMES, "first": bad[:1]}
        out["batches"].append({"B": b, **first})
        log(f"moshi B={b}: " + ", ".join(f"{k} {v['rows_frames_differing']}/{v['of']} differ" for k, v in first.items()))
    results["moshi_lm"] = out
    del gen, lm
    torch.cuda.empty_cache()


def dit() -> None:
    from cadence_fx.adapters.stepaudio2 import load_stepaudio2
    from cadence_fx.adapters.token2wav import DiTStep, Token2WavConfig
    from cadence_fx.adapters.token2wav.build import build_dit

    up = load_stepaudio2(UP / "minicpmo-0.1.2")
    cfg = Token2WavConfig.reduced() if REDUCED else Token2WavConfig()
    step = DiTStep(build_dit(up, cfg), cfg).eval().to(DEV)
    n_conv = max(BATCHES)
    prompts = [step.fresh(1, seed=100 + i, frames=cfg.prompt_frames, device=DEV)[0] for i in range(n_conv)]
    chunks = [step.fresh(CHUNKS, seed=200 + i, device=DEV) for i in range(n_conv)]
    out = {}

    def workspaces(convs: int) -> None:
        # the DiT writes its caches into workspaces of CFG batch 2: B conversations need 2B rows of
        # them (only the capacity changes; each call's results are cloned out)
        for name in ("cnn_cache_buffer", "att_cache_buffer"):
            old = getattr(step.estimator.upstream, name)
            shape = list(old.shape)
            shape[1] = 2 * convs
            step.estimator.upstream.register_buffer(name, old.new_zeros(shape), persistent=False)

    for dtype in (torch.float32, torch.float16):
        amp = dict(device_type=DEV, dtype=torch.float16, enabled=dtype == torch.float16 and DEV == "cuda")
        with torch.inference_mode(), torch.autocast(**amp):
            workspaces(1)
            states = [step.setup(**p) for p in prompts]

            def stream(convs: range) -> list[tuple[torch.Tensor, ...]]:
                workspaces(len(convs))
                cnn = torch.cat([states[i]["cnn_cache"] for i in convs], dim=1)
                att = torch.cat([states[i]["att_cache"] for i in convs], dim=1)
                res = []
                for k in range(CHUNKS):
                    call = {key: torch.cat([chunks[i][k][key] for i in convs]) for key in chunks[0][k]}
                    y, cnn, att = step(**call, cnn_cache=cnn, att_cache=att)
                    res.append((y.clone(), cnn.clone(), att.clone()))
                sync()
                return res

            solo = [stream(range(i, i + 1)) for i in range(n_conv)]
            rep = all(same(a, b) for fa, fb in zip(solo[0], stream(range(0, 1))) for a, b in zip(fa, fb))
            rows = {"solo_repeatable": rep, "batches": []}
            log(f"dit {dtype} solo repeated: {'exact' if rep else 'DIFFERS'}")
            for b in BATCHES:
                batched = stream(range(b))
                diff = {}
                for part, name, dim in ((0, "velocity", 0), (1, "cnn_cache", 1), (2, "att_cache", 1)):
                    bad = [(i, k) for i in range(b) for k in range(CHUNKS)
                           if not same(batched[k][part].narrow(dim, 2 * i, 2), solo[i][k][part])]
                    diff[name] = {"rows_chunks_differing": len(bad), "of": b * CHUNKS, "first": bad[:1]}
                rows["batches"].append({"B": b, **diff})
                log(f"dit {dtype} B={b}: " + ", ".join(f"{k} {v['rows_chunks_differing']}/{v['of']} differ"
                                                    for k, v in diff.items()))
        out[str(dtype)] = rows
    results["dit"] = out


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for part in sys.argv[1:] or ["gemm", "dit", "moshi"]:
        t0 = time.perf_counter()
        try:
            {"gemm": gemm_rows, "dit": dit, "moshi": moshi}[part]()
        except Exception as e:  # a part that fails is recorded; the others still run
            results[part + "_error"] = repr(e)
            log(f"{part} failed: {e!r}")
        log(f"[{part}] {time.perf_counter() - t0:.1f} s")
        (OUT / "batch_probe.json").write_text(json.dumps(results, indent=1))
