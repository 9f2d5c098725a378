"""Token2Wav (MiniCPM-o 4.5 / Step-Audio2 streaming decoder) under cadence_fx, end to end.

    python examples/token2wav.py                       # released sizes on a GPU (random weights)
    python examples/token2wav.py --reduced --chunks 5  # small, on the CPU

What an export script does with the real decoder: build the stock step from the upstream modules
(here with random weights; with a checkpoint, pass the loaded ``flow`` and ``hift`` modules to
``Token2WavStep``), run the prompt once, export one program per catalog class, optimize, capture,
then stream. The stream is run twice, through the stock code and through the optimized program, and
the PCM bytes of both are compared (SHA-256). Needs ``stepaudio2`` from ``minicpmo`` 0.1.2 installed
with ``pip install --no-deps --target .upstream/minicpmo-0.1.2 minicpmo==0.1.2`` (``scripts/test.sh``
does it) or ``$CADENCE_FX_UPSTREAM`` pointing at such a folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cadence_fx as cf  # noqa: E402
from cadence_fx.adapters import token2wav as t2w  # noqa: E402
from cadence_fx.adapters.stepaudio2 import load_stepaudio2  # noqa: E402
from cadence_fx.determinism import pin_envelope, sha256_tensors  # noqa: E402
from benchmarks.harness import sync  # noqa: E402


def stream(fn, step: t2w.Token2WavStep, state: dict, fresh: list, seed: int) -> tuple[list[torch.Tensor], list[float]]:
    """Feed ``fresh`` through ``fn`` from ``state``, carrying the state; returns the PCM chunks and ms per chunk."""
    torch.manual_seed(seed)  # HiFT draws random numbers: both runs draw the same ones
    st = {k: v.clone() for k, v in state.items()}
    pcm, ms = [], []
    for f in fresh:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn(*step.next_args(f, st))
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
        pcm.append(out[0].clone())
        st = step.carry(out)
    return pcm, ms


def main(argv: list[str] | None = None) -> bool:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=12, help="chunks of 25 tokens (+3 lookahead) to stream")
    ap.add_argument("--reduced", action="store_true", help="reduced sizes (fast, CPU)")
    ap.add_argument("--granularity", choices=("chunk", "step"), default="chunk",
                    help="replay the whole CFM loop per chunk, or each solver step")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pin_envelope()  # cuDNN deterministic: the stock code reproduces its own bytes only under it

    up = load_stepaudio2(Path(os.environ.get("CADENCE_FX_UPSTREAM", ROOT / ".upstream")) / "minicpmo-0.1.2")
    cfg = t2w.Token2WavConfig.reduced() if args.reduced else t2w.Token2WavConfig()
    torch.manual_seed(cfg.seed)
    # 1. the stock streaming step (flow chunk + the driver's trims + HiFT), and the prompt's state
    step = t2w.Token2WavStep(t2w.build_flow(up, cfg), t2w.build_vocoder(up, cfg), cfg, driver="0.1.2")
    step = step.to(device).eval()
    prompt_tokens, prompt_mel, spk = (t.to(device) for t in t2w.example_prompt(cfg))
    state = step.setup(prompt_tokens, prompt_mel, spk)

    # 2. the contract and one exported program per catalog class (history 302, 352, 402 frames)
    contract = t2w.token2wav_contract(cfg, args.granularity, driver="0.1.2")
    eps = t2w.export_step_catalog(step, state, step.fresh(3, spk, seed=99), contract, granularity=args.granularity)
    print(cf.plan(eps, contract))

    # 3. optimize and capture the catalog before traffic
    prog = cf.optimize(eps, contract)
    warm = prog.warmup(*[step.fresh(1, spk)[0].get(n) for n in step.inputs])

    # 4. the same stream through the stock code and through the optimized program
    fresh = step.fresh(args.chunks, spk, seed=1)
    stock_pcm, stock_ms = stream(step.stock_call, step, state, fresh, seed=7)
    opt_pcm, opt_ms = stream(prog, step, state, fresh, seed=7)
    same = sha256_tensors(stock_pcm) == sha256_tensors(opt_pcm)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"\n{args.chunks} chunks on {device}, {args.granularity} clock")
    print(f"  PCM SHA-256 stock    : {sha256_tensors(stock_pcm)}")
    print(f"  PCM SHA-256 optimized: {sha256_tensors(opt_pcm)}")
    print(f"  bit-identical        : {same}")
    print(f"  p50 per chunk        : stock {median(stock_ms):.1f} ms, optimized {median(opt_ms):.1f} ms "
          f"(warm-up {warm['seconds']:.1f} s)")
    print(f"  replay counters      : {prog.counters()}")
    return same


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
