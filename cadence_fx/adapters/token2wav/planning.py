"""``cadence-fx plan token2wav``: the released flow step exported once, with its contract, for the plan."""

from __future__ import annotations

import os
import types
from pathlib import Path

import torch
from torch.export import ExportedProgram

from cadence_fx.adapters.token2wav.build import build_flow
from cadence_fx.adapters.token2wav.config import Token2WavConfig
from cadence_fx.adapters.token2wav.contracts import token2wav_contract
from cadence_fx.adapters.token2wav.steps import Token2WavStep, example_prompt
from cadence_fx.contract import Contract

__all__ = ["export_plan_step", "plan_target"]

REPO = Path(__file__).resolve().parents[3]


def export_plan_step(up: types.SimpleNamespace, cfg: Token2WavConfig | None = None) -> tuple[ExportedProgram, Contract]:
    """The flow step at ``cfg`` (default: released) exported once, for :func:`cadence_fx.plan`, and its contract.

    The plan reads shapes only (the workspaces the program allocates, the region inputs), so the
    step is exported with a single solver step from zero state: the shapes are those of the full
    loop at a fraction of the tracing work. The contract carries the configured solver steps.
    """
    cfg = Token2WavConfig() if cfg is None else cfg
    step = Token2WavStep(build_flow(up, cfg), None, cfg, n_timesteps=1).eval()
    _tokens, _mel, spk = example_prompt(cfg)
    args = step.next_args({"token": torch.zeros(1, cfg.call_tokens, dtype=torch.int32), "spk": spk},
                          step.example_state())
    contract = token2wav_contract(cfg, vocoder=False)
    with step.export_context(contract):  # the estimator visible: the contract splits at it
        ep = torch.export.export(step, args)
    return ep, contract


def plan_target(root: str | os.PathLike | None = None) -> tuple[ExportedProgram, Contract]:
    """``cadence-fx plan token2wav``: the released flow step of minicpmo 0.1.2 and its contract.

    ``root`` is the folder holding ``minicpmo-0.1.2/`` (default: ``$CADENCE_FX_UPSTREAM``, else
    ``<repo>/.upstream``).
    """
    from cadence_fx.adapters.upstream import load_stepaudio2

    base = Path(root or os.environ.get("CADENCE_FX_UPSTREAM") or REPO / ".upstream")
    return export_plan_step(load_stepaudio2(base / "minicpmo-0.1.2"))
