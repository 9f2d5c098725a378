"""``cadence-fx plan token2wav``: the released flow step exported once, with its contract, for the plan."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import torch
from torch.export import ExportedProgram

from cadence_fx.adapters.stepaudio2 import UpstreamNotFound, load_stepaudio2
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

    The release is looked for in ``root`` (a folder holding ``minicpmo-0.1.2/``), else
    ``$CADENCE_FX_UPSTREAM``, else a source checkout's ``.upstream/``, else an installed
    ``stepaudio2`` on the import path (``pip install --no-deps minicpmo==0.1.2``): a wheel of
    cadence_fx has no ``.upstream/``.

    Raises:
        UpstreamNotFound: none of them holds the release.
    """
    bases = [Path(root)] if root else [Path(os.environ["CADENCE_FX_UPSTREAM"])] \
        if os.environ.get("CADENCE_FX_UPSTREAM") else [REPO / ".upstream"]
    for base in bases:
        if (base / "minicpmo-0.1.2" / "stepaudio2").is_dir():
            return export_plan_step(load_stepaudio2(base / "minicpmo-0.1.2"))
    spec = None if root else importlib.util.find_spec("stepaudio2")
    if spec is not None and spec.submodule_search_locations:
        return export_plan_step(load_stepaudio2(Path(list(spec.submodule_search_locations)[0]).parent))
    raise UpstreamNotFound(f"minicpmo 0.1.2 not found in {', '.join(str(b) for b in bases)} nor on the import path; "
                           f"install it with: pip install --no-deps minicpmo==0.1.2 (and einops, scipy)")
