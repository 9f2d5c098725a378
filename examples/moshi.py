"""Moshi (Kyutai's full-duplex speech model) under cadence_fx, end to end.

    python examples/moshi.py                        # released sizes on a GPU (random weights, 7B in bf16)
    python examples/moshi.py --reduced --frames 8   # small, on the CPU

What an export script does with the stock stack: build the upstream modules (here with random
weights; with a checkpoint, pass the ``LMGen`` and ``MimiModel`` that ``moshi.models.loaders`` gives
to the steps), wrap each per-frame entry point as a step whose streaming state is explicit
(``MimiEncodeStep``, ``LMStep``, ``MimiDecodeStep``), export each step, optimize it under its contract
(the ring KV caches and conv contexts become contract-owned buffers), capture, then stream. The same
stream of user audio is run through the stock code (each module keeping its own state, as
``moshi/server.py`` runs it) and through the optimized programs, with the same sampling seed, and the
SHA-256 of every frame's text token, audio codes and PCM are compared. Needs ``moshi`` 0.2.13
installed with ``pip install --no-deps --target .upstream/moshi-0.2.13 moshi==0.2.13``
(``scripts/test.sh`` does it), ``$CADENCE_FX_UPSTREAM`` pointing at a folder holding that, or an
importable ``moshi``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# moshi wraps its RMS norm, RoPE and gating kernels in torch.compile on CUDA (read at import):
# compiled kernels are not the eager ones, so both runs use the eager kernels
os.environ.setdefault("NO_TORCH_COMPILE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cadence_fx as cf  # noqa: E402
from cadence_fx.adapters import moshi as mo  # noqa: E402
from cadence_fx.adapters.streaming import export_step_catalog  # noqa: E402
from cadence_fx.determinism import pin_envelope, sha256_tensors  # noqa: E402
from benchmarks.harness import sync  # noqa: E402

STAGES = ("encode", "lm", "decode")


def main(argv: list[str] | None = None) -> bool:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=50, help="80 ms frames to stream")
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (fast, CPU)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pin_envelope()

    # 1. the stock modules (LMGen over the LM, Mimi) and the three steps over them
    up = mo.load_moshi()
    cfg = mo.MoshiConfig.reduced() if args.reduced else mo.MoshiConfig()
    steps = mo.build_steps(up, cfg, device)
    pcm = mo.user_audio(args.frames, seed=1, device=device)

    # 2. the stock stream first (it installs its own state in the modules), as moshi runs it
    torch.manual_seed(7)
    sync()
    t0 = time.perf_counter()
    stock = mo.stock_stream(steps, steps.initial_state(), pcm)
    sync()
    stock_s = time.perf_counter() - t0

    # 3. per step: its contract, the exported program, the optimized program, captured before traffic
    examples = steps.examples()
    progs = {}
    replay = mo.shared_replay(device)  # the three run one after the other: one capture stream for all
    for name in STAGES:
        step = getattr(steps, name)
        contract = mo.moshi_contract(step)
        eps = export_step_catalog(step, step.initial_state(), [{"x": examples[name]}], contract)
        progs[name] = cf.optimize(eps, contract, replay=replay)
        progs[name].warmup(examples[name])
        fields = sorted({step.slot_of(r.input).field for r in contract.regions})
        mib = sum(rp.stored_bytes for rp in progs[name].plan.regions) / 2**20
        print(f"{name}: {len(contract.regions)} regions ({', '.join(fields)}), {mib:.1f} MiB of contract-owned state")

    # 4. the same stream through the optimized programs
    torch.manual_seed(7)
    sync()
    t0 = time.perf_counter()
    opt = mo.step_stream(steps, progs, steps.initial_state(), pcm)
    sync()
    opt_s = time.perf_counter() - t0

    digest = lambda frames: sha256_tensors([t for f in frames for t in f.tensors()])  # noqa: E731
    same = digest(stock) == digest(opt)
    print(f"\n{args.frames} frames on {device} ({'reduced' if args.reduced else 'released'} sizes)")
    print(f"  text tokens (first 8)     : {[int(f.tokens[0, 0, 0]) for f in stock[:8]]}")
    print(f"  tokens+PCM SHA-256 stock  : {digest(stock)}")
    print(f"  tokens+PCM SHA-256 cadence: {digest(opt)}")
    print(f"  bit-identical             : {same}")
    print(f"  ms per frame              : stock {1e3 * stock_s / args.frames:.1f}, "
          f"optimized {1e3 * opt_s / args.frames:.1f} (first-call copies and captures included)")
    print(f"  replays per step          : { {n: p.counters()['replays'] for n, p in progs.items()} }")
    return same


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
