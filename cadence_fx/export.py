"""Exporting a streaming step once per catalog class.

A step exported with static shapes is one program per class of region extents
(:func:`cadence_fx.call_classes`). :func:`example_inputs` turns one class into example inputs for
``torch.export`` from one call's worth of inputs; :func:`export_catalog` exports every class.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.export import ExportedProgram

from cadence_fx.contract import Contract, ContractError
from cadence_fx.plan import call_classes
from cadence_fx.progress import Progress

__all__ = ["example_inputs", "export_catalog"]


def example_inputs(contract: Contract, cls: Mapping[str, int], example: Mapping[str, Any]) -> tuple[Any, ...]:
    """The inputs of one call of class ``cls``, as a tuple in the order of ``example``.

    ``example`` maps every input name of the step (in ``forward``'s order) to a value for one call;
    each region's input is resized on its clock axis to the class's extent (zeros, or the
    example's first positions when it is longer), everything else is passed as it is. Values do not
    matter for export, shapes do.
    """
    out = dict(example)
    for r in contract.regions:
        if r.output is None:  # a module buffer: not an input, and the same shape in every class
            continue
        if r.name not in cls:
            raise ContractError(f"example_inputs: class {dict(cls)} has no extent for region {r.name!r}")
        if r.input not in out:
            raise ContractError(f"Region {r.name!r}.input: {r.input!r} is not among the example inputs {list(out)}")
        t = out[r.input]
        if not isinstance(t, torch.Tensor) or not -t.dim() <= r.axis < t.dim():
            raise ContractError(f"Region {r.name!r}: example input {r.input!r} has no axis {r.axis}")
        axis, extent = r.axis % t.dim(), cls[r.name]
        shape = list(t.shape)
        shape[axis] = extent
        resized = torch.zeros(shape, dtype=t.dtype, device=t.device)
        n = min(extent, t.shape[axis])
        resized.narrow(axis, 0, n).copy_(t.narrow(axis, 0, n))
        out[r.input] = resized
    return tuple(out.values())


def export_catalog(step: torch.nn.Module, contract: Contract, example: Mapping[str, Any],
                   **export_kwargs: Any) -> list[ExportedProgram]:
    """``torch.export.export`` of ``step`` once per catalog class of ``contract`` (static shapes)."""
    classes = call_classes(contract)
    eps = []
    with Progress("cadence_fx export", len(classes)) as bar:  # a line on stderr once it takes a while
        for cls in classes:
            eps.append(torch.export.export(step, example_inputs(contract, cls, example), **export_kwargs))
            bar.advance()
    return eps
