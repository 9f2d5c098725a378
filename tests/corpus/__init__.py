"""The corpus: real upstream streaming models from PyPI that no file of cadence_fx was written against.

Each module of this package builds one :class:`CorpusCase`: the upstream model at reduced sizes with
random weights, the streaming step a user would write around it, the contract, and a stream of
inputs. ``tests/test_corpus.py`` runs every case the same way: optimize, drive a stream of at least
12 calls against the unmodified exported programs, sessions with snapshot/restore, state traffic
against stock, and the proposed contract.

The user's code of a case (the wrapper and the contract) sits between the lines
``# user code begins`` and ``# user code ends`` of its module; :func:`user_lines` counts the
non-blank, non-comment lines there (the README's table reports them).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.export import ExportedProgram

import cadence_fx as cf

# the modules of this package that define a case, in the order the README's table lists them
CASES = ("code2wav", "static_cache_llm", "emformer", "mimi_encoder", "rnnt_predictor", "demucs_streamer")


@dataclass
class CorpusCase:
    """One real upstream streaming model bound to cadence_fx.

    Attributes:
        name: short label (the module name).
        upstream: what is imported, with its release (``"transformers 5.24.0: Qwen3OmniMoeCode2Wav"``).
        step: the streaming step module (eval mode), as the user exports it.
        contract: the hand-written contract.
        export: exports the catalog (one program per class, or one program) from ``step``.
        inputs: call ``k``'s inputs that are not state (by input name); state inputs come from the
            previous call's outputs (or ``initial`` at the first call).
        initial: each region input's value at the first call, by input name (regions kept in module
            buffers need none: the program holds them).
        calls: how many calls the stream has (at least 12).
        notes: what binding this model took beyond the wrapper (shown in the README table).
    """

    name: str
    upstream: str
    step: torch.nn.Module
    contract: cf.Contract
    export: Callable[[], list[ExportedProgram]]
    inputs: Callable[[int], dict[str, Any]]
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    calls: int = 12
    notes: str = ""


def load(name: str) -> CorpusCase:
    """The case of corpus module ``name`` (``tests/corpus/<name>.py``'s ``case()``)."""
    return importlib.import_module(f"{__name__}.{name}").case()


def user_lines(name: str) -> int:
    """Non-blank, non-comment lines between the user-code markers of corpus module ``name``."""
    src = inspect.getsource(importlib.import_module(f"{__name__}.{name}")).splitlines()
    begin = [i for i, line in enumerate(src) if line.strip() == "# user code begins"]
    end = [i for i, line in enumerate(src) if line.strip() == "# user code ends"]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise ValueError(f"corpus module {name!r}: one '# user code begins' and one '# user code ends' line expected")
    body = [line.strip() for line in src[begin[0] + 1:end[0]]]
    return sum(1 for line in body if line and not line.startswith("#"))


def drive(fn: Callable[..., Any], case: CorpusCase, names: Sequence[str], calls: int | None = None,
          *, start: int = 0, state: dict[str, torch.Tensor] | None = None
          ) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Run ``calls`` calls of ``case``'s stream through ``fn`` (a program or session), feeding each
    region's output back as its input. ``names``: the callable's inputs in order.

    Returns (each call's outputs, cloned as a consumer would read them; the state to feed next).
    """
    regions = [r for r in case.contract.regions if r.input in names and r.output is not None]
    state = dict(case.initial if state is None else state)
    outs = []
    for k in range(start, start + (calls if calls is not None else case.calls)):
        given = dict(case.inputs(k))
        given.update({r.input: state[r.input] for r in regions})
        o = fn(*[given[n] for n in names])
        flat = list(o) if isinstance(o, (tuple, list)) else [o]
        outs.append([t.clone() if isinstance(t, torch.Tensor) else t for t in flat])
        state = {r.input: flat[r.output] for r in regions}
    return outs, state
