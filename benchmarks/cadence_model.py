"""What every process of the cadence benchmark builds: the model (Token2Wav, the demo decoder, Moshi or Code2Wav).

:class:`Bench` is what a process needs of its model: the stock step, its initial (prompt) state and
the catalog to optimize. :func:`child_setup` is the set-up every model-building process runs first,
so that every process reduces in the same order. :func:`dtype_hook` maps ``--dtype`` to this
checkout's ``benchmarks.token2wav.build_step`` (or says why it cannot).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from benchmarks.token2wav import EXPORT_SEED, build_step, pick_device
from cadence_fx.determinism import pin_envelope


@dataclass
class Bench:
    """What the benchmark needs of a model: the stock step, its initial state, and its catalog."""

    step: Any  # StreamingStep: inputs, fresh, next_args, carry, driver_call
    spk: Any
    state0: dict
    contract: Any  # the contract the program is optimized for
    export: Callable[[], list]  # the catalog, exported from the stock step


def dtype_hook(dtype: str) -> dict:
    """The keyword arguments that ask ``benchmarks.token2wav.build_step`` for ``dtype``; SystemExit with
    the reason where this checkout's build has no such path."""
    if dtype == "float32":
        return {}
    params = inspect.signature(build_step).parameters
    if "dtype" in params:
        return {"dtype": getattr(torch, dtype)}
    if dtype == "float16" and "float16" in params:
        return {"float16": True}
    raise SystemExit(f"--dtype {dtype}: benchmarks/token2wav.py build_step{inspect.signature(build_step)} takes no "
                     f"'dtype' or 'float16' argument: this checkout has no {dtype} Token2Wav path")


def build_bench(args, device: str) -> Bench:
    if args.model == "demo":
        return _demo_bench(device)
    if args.model == "moshi":  # the stock and solo processes' Moshi (the SRc worker's: benchmarks/cadence_moshi.py)
        from benchmarks.cadence_moshi import stock_bench

        return stock_bench(args, device)
    if args.model == "code2wav":  # benchmarks/cadence_code2wav.py
        from benchmarks.cadence_code2wav import code2wav_bench

        return code2wav_bench(args, device)
    t2w, cfg, step, (tokens, mel, spk) = build_step(args, device, **dtype_hook(args.dtype))
    state0 = step.setup(tokens, mel, spk)

    def export():
        # the "step" routing installs both the CFM-loop and the estimator proxies: one export serves both clocks
        return t2w.export_step_catalog(step, state0, step.fresh(3, spk, seed=EXPORT_SEED),
                                       t2w.token2wav_contract(cfg, "step", driver="0.1.2"), granularity="step")

    contract = t2w.token2wav_contract(cfg, "chunk", driver="0.1.2", step_segments=True)
    return Bench(step, spk, state0, contract, export)


def _demo_bench(device: str) -> Bench:
    from cadence_fx.adapters.streaming import StreamingStep
    from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

    class DemoStep(StreamingStep):
        """The demo decoder as a streaming step (noise is a per-chunk input: the stream draws nothing)."""

        inputs = ("tokens", "enc_kv", "est_kv", "conv", "noise")
        state = {"enc_kv": 1, "est_kv": 2, "conv": 3}

        def __init__(self, cfg: DemoConfig) -> None:
            super().__init__()
            self.cfg = cfg
            self.model = StreamingDecoder(cfg).eval()

        def forward(self, *args):
            return self.model(*args)

        driver_call = forward

        def fresh(self, n: int, spk, *, seed: int = 0) -> list[dict]:
            g = torch.Generator().manual_seed(seed)
            shape = (1, self.cfg.chunk, self.cfg.dim)
            return [{"tokens": torch.randn(*shape, generator=g).to(device),
                     "noise": torch.randn(*shape, generator=g).to(device)} for _ in range(n)]

    cfg = DemoConfig()
    torch.manual_seed(0)
    step = DemoStep(cfg).to(device)
    state0 = dict(zip(("enc_kv", "est_kv", "conv"), step.model.initial_state(device=device)))
    contract = demo_contract(cfg)
    return Bench(step, None, state0, contract, lambda: export_catalog(step.model, contract, device=device))


def child_setup() -> str:
    """Every process that builds a model: the same envelope and, on the CPU, one thread (the same
    reduction order in every process, and no oversubscription when the processes share a host)."""
    pin_envelope()
    device = pick_device()
    if device == "cpu":
        torch.set_num_threads(1)
    return device


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"
