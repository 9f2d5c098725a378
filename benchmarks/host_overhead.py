"""Host time per call of an optimized program, the GPU left out: the Moshi LM step on the CPU.

    python benchmarks/host_overhead.py [--layers 32] [--calls 200] [--without bind_constants]

The reduced Moshi LM (``MoshiConfig.reduced``, greedy: no sampling, so nothing is host randomness)
with ``--layers`` temporal layers (32 released: 99 state regions), exported and optimized with the
whole step replayed through a backend whose replay does nothing. What a call then costs is the
program's own host work (input dispatch, state adoption, the outer graph, the replay engine's
signature check), which on the GPU runs before the replay can be launched. ``--without PASS`` drops a
pass from the pipeline, to measure what it saves. Prints microseconds per call and the top of a profile.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cadence_fx as cf  # noqa: E402
import cadence_fx.pipeline as pipeline  # noqa: E402
from cadence_fx.adapters import moshi as mo  # noqa: E402
from cadence_fx.adapters.streaming import export_step_catalog  # noqa: E402
from cadence_fx.testing.fake_backend import FakeBackend  # noqa: E402


class NoReplay(FakeBackend):
    """Captures as the fake backend does; a replay does nothing (only the host work is timed)."""

    def capture(self, fn, static_args, pool):
        _replay, outputs, nbytes = super().capture(fn, static_args, pool)
        return (lambda: None), outputs, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--without", default=None, help="a pass to drop from the pipeline (e.g. bind_constants)")
    ap.add_argument("--session", action="store_true",
                    help="call through a session on a lane after the first (the serving path) instead of the "
                         "program's own calls (the default session, lane 0)")
    ap.add_argument("--profile", type=int, default=15, help="profile lines to print (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.without:
        pipeline.PIPELINE = tuple(p for p in pipeline.PIPELINE if p.__name__ != args.without)
    up = mo.load_moshi()
    lm = dict(mo.MoshiConfig.reduced().lm_overrides, num_layers=args.layers)
    cfg = mo.MoshiConfig.reduced(lm_overrides=lm, use_sampling=False)
    steps = mo.build_steps(up, cfg, "cpu")
    step, x = steps.lm, steps.examples()["lm"]
    contract = mo.moshi_contract(step)
    prog = cf.optimize(export_step_catalog(step, step.initial_state(), [{"x": x}], contract), contract,
                       replay=NoReplay(), state=True, lanes=2 if args.session else 1)
    prog.warmup(x)
    st = step.initial_state()
    call = prog.session("host", seed=0) if args.session else prog

    def calls(n: int) -> None:
        nonlocal st
        for _ in range(n):
            st = step.carry(call(*step.next_args({"x": x}, st)))

    calls(3)
    t0 = time.perf_counter()
    calls(args.calls)
    per_call = (time.perf_counter() - t0) / args.calls
    counters = prog.counters()
    print(f"{args.layers} layers, {len(contract.regions)} regions, {'a session' if args.session else 'default calls'}, "
          f"pipeline without {args.without or 'nothing'}: "
          f"{per_call * 1e6:.0f} us per call (replays {counters['replays']}, eager {counters['eager']})")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        calls(50)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
