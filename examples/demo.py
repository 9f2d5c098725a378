"""cadence_fx demo: export a streaming decoder, optimize it, and check it is the same program.

    python examples/demo.py            # CPU or GPU, whichever is there
    python examples/demo.py --calls 40 --dim 256

Prints the plan, then runs one stream through the unmodified exported program and one through the
optimized program, and prints the SHA-256 of both output streams, where every state region lives
across calls, the memory each run needed, and (on a GPU) the per-call speedup.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cadence_fx as cf  # noqa: E402
from benchmarks.harness import peak_mib, time_stream  # noqa: E402
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog  # noqa: E402
from cadence_fx.determinism import pin_envelope, sha256_tensors  # noqa: E402
from cadence_fx.runtime.catalog import reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pin_envelope()
    cfg = DemoConfig(dim=args.dim, chunk=8, prompt=24, head=24, tail=16, steps=4, slots=6, capacity=128)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().to(device)
    contract = demo_contract(cfg)

    # 1. export: one static-shape program per catalog class (the extents the plan enumerates)
    eps = export_catalog(model, contract, device=device)
    print(cf.plan(eps, contract), "\n")

    # 2. optimize
    prog = cf.optimize(eps, contract)
    state0 = model.initial_state(device=device)
    if device == "cuda":
        report = prog.warmup(torch.zeros(1, cfg.chunk, cfg.dim, device=device), *state0,
                             torch.zeros(1, cfg.chunk, cfg.dim, device=device))
        print(f"warm-up: captured the catalog in {report['seconds']:.2f} s\n")

    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device),
               torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device)) for _ in range(args.calls)]
    stock = reference(eps)  # the unmodified exported programs, dispatched by exact input signature

    def run(fn, record_ptrs=None):
        state = [s.clone() for s in state0]

        def step(k):
            out = fn(inputs[k][0], *state, inputs[k][1])
            state[:] = out[1:]
            if record_ptrs is not None:
                record_ptrs.append([t.data_ptr() for t in out[1:]])
            return out
        return step

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eager = time_stream(run(stock), args.calls, emitted=lambda o: [o[0]])
    eager.peak_mib = peak_mib(reset=True)
    ptrs: list[list[int]] = []
    fast = time_stream(run(prog, ptrs), args.calls, emitted=lambda o: [o[0]])
    fast.peak_mib = peak_mib()

    print(f"stream of {args.calls} calls on {device}")
    print(f"  SHA-256 unmodified: {eager.sha256}")
    print(f"  SHA-256 optimized : {fast.sha256}")
    print(f"  bit-identical     : {eager.sha256 == fast.sha256}")
    for i, r in enumerate(contract.regions):
        moved = len({p[i] for p in ptrs[1:]})
        print(f"  region {r.name:<13} data_ptr {'stable' if moved == 1 else f'MOVED ({moved} addresses)'}"
              f" at {ptrs[-1][i]:#x}")
    print(f"  state fed back in place: {prog.stats['state_in_place']}, adopted by copy: {prog.stats['state_adopted']}")
    if device == "cuda":
        print(f"  peak allocated MiB: unmodified {eager.peak_mib:.1f}, optimized {fast.peak_mib:.1f}")
        print(f"  p50 per call: unmodified {eager.p50:.2f} ms, optimized {fast.p50:.2f} ms "
              f"-> {eager.p50 / fast.p50:.2f}x" if eager.sha256 == fast.sha256 else "  (not exact: no speedup)")
        print(f"  replay counters: {prog.counters()}")
    else:
        mib = sum(b.numel() * b.element_size() for b in prog.region_buffers.values()) / 2**20
        print(f"  contract-owned state: {mib:.3f} MiB in {len(prog.region_buffers)} buffers (no GPU: no peak/speedup)")
    if eager.sha256 != fast.sha256:
        sys.exit("output streams differ")

    # 3. sessions: three conversations interleaved on one program (weights and graphs shared), each with
    #    its own prompt; every session's stream must equal that conversation run alone, unmodified
    prompts = [[s + 0.01 * i for s in state0] for i in range(3)]
    solo = []
    for prompt in prompts:
        state, out = [s.clone() for s in prompt], []
        for k in range(args.calls):
            o = stock(inputs[k][0], *state, inputs[k][1])
            out.append(o[0].clone())
            state = [t.clone() for t in o[1:]]
        solo.append(sha256_tensors(out))
    sessions = [prog.session(f"conversation-{i}") for i in range(3)]
    states = [list(p) for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in sessions]
    for k in range(args.calls):
        for i, sess in enumerate(sessions):
            o = sess(inputs[k][0], *states[i], inputs[k][1])
            got[i].append(o[0].clone())
            states[i] = list(o[1:])
    same = [sha256_tensors(g) == s for g, s in zip(got, solo)]
    print(f"\n3 sessions interleaved, {sessions[0].nbytes() / 2**20:.3f} MiB of state each: "
          f"each equal to its solo unmodified run: {same}")
    if not all(same):
        sys.exit("a session's stream differs from its solo run")


if __name__ == "__main__":
    main()
