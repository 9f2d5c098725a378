"""Model-agnostic streaming steps: export one program per catalog class, and drive a stream.

A :class:`StreamingStep` is an ``nn.Module`` whose state inputs are fed from its own outputs.
:func:`export_step_catalog` exports it once per catalog class of a contract, from a real stream's
inputs; :func:`run_stream` drives any callable with the step's calling convention (the eager step,
a stock driver, the unmodified exported programs, an optimized program) through a stream. A model
that needs something in place while it is exported (proxies that make a call visible, say)
provides it through :meth:`StreamingStep.export_context`; nothing here knows any model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.export import ExportedProgram

from cadence_fx.contract import Contract
from cadence_fx.plan import call_classes
from cadence_fx.progress import Progress
from cadence_fx.runtime.catalog import Catalog, reference

__all__ = ["CatalogReference", "StreamingStep", "export_step_catalog", "run_stream", "signature"]


class StreamingStep(nn.Module):
    """A step whose state inputs are fed from its own outputs: ``inputs`` names the user inputs in
    order, ``state`` maps each state input to the output index that carries it to the next call."""

    inputs: tuple[str, ...] = ()
    state: Mapping[str, int] = {}

    def next_args(self, fresh: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> tuple:
        """Arguments for one call from the per-call inputs ``fresh`` and the carried ``state``."""
        merged = {**fresh, **state}
        return tuple(merged[n] for n in self.inputs)

    def carry(self, outputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state for the next call, read from this call's outputs."""
        return {name: outputs[i] for name, i in self.state.items()}

    def export_context(self, contract: Contract, granularity: str | None = None) -> contextlib.AbstractContextManager:
        """What must be in place while the step is exported for ``contract`` (entered once per
        ``torch.export`` call, left before the eager calls). ``granularity`` is the caller's choice,
        passed through from :func:`export_step_catalog`; its meaning is the step's own.

        Default: nothing. A step whose wrapped callables are entered through something other than
        ``__call__`` overrides this to install proxies that export can see.
        """
        return contextlib.nullcontext()


def signature(args: Sequence[Any]) -> tuple:
    """The static signature an exported program is specialised to: shapes and dtypes of the tensors."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args)


def export_step_catalog(step: StreamingStep, state: Mapping[str, torch.Tensor],
                        fresh: Sequence[Mapping[str, torch.Tensor]], contract: Contract, *,
                        granularity: str | None = None) -> list[ExportedProgram]:
    """One static-shape ``torch.export`` program per catalog class of ``contract``.

    The step runs eagerly from ``state`` (the stock computation, on the step's own modules) for as
    many calls as the catalog has classes; each call whose signature is new is then exported with
    that call's real inputs as example inputs, inside ``step.export_context(contract, granularity)``.
    Raises ``ValueError`` when ``fresh`` has fewer calls than the catalog has classes.
    """
    n = len(call_classes(contract))
    if len(fresh) < n:
        raise ValueError(f"export_step_catalog: {n} catalog classes need {n} calls of fresh inputs, got {len(fresh)}")
    # First walk the catalog eagerly, so every lazily grown table (a positional encoding, say)
    # already covers the longest extent before tracing starts; then export each class.
    calls: list[tuple] = []
    seen: set[tuple] = set()
    st = {k: v.clone() for k, v in state.items()}
    # one line on stderr once it takes a while (the released Token2Wav catalog: about a minute)
    with Progress("cadence_fx export", 2 * n) as bar:
        for k in range(n):
            args = step.next_args(fresh[k], st)
            if signature(args) not in seen:
                seen.add(signature(args))
                calls.append(tuple(a.clone() for a in args))
            with torch.no_grad():
                outs = step(*args)
            st = {name: t.clone() for name, t in step.carry(outs).items()}
            bar.advance(note="eager walk")
        bar.total = n + len(calls)
        _normalize_inference_tensors(step)
        eps: list[ExportedProgram] = []
        for args in calls:
            with step.export_context(contract, granularity):
                eps.append(torch.export.export(step, args))
            bar.advance(note="torch.export")
    return eps


def _normalize_inference_tensors(module: nn.Module) -> None:
    """Replace tensors a model cached under ``torch.inference_mode`` by plain copies.

    Upstream setup and chunk functions often run in inference mode, and a table grown lazily
    there (the Token2Wav conformer's positional encoding, ``extend_pe``, when a stream is longer
    than its initial table) becomes an inference tensor, which export (tracing with autograd on)
    refuses. Same values, plain tensors; the user's modules keep working as before.
    """
    for mod in module.modules():
        for key, val in list(vars(mod).items()):
            if isinstance(val, torch.Tensor) and not isinstance(val, nn.Parameter) and val.is_inference():
                setattr(mod, key, val.clone())
        for key, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_inference():
                mod._buffers[key] = buf.clone()


class CatalogReference:
    """The unmodified exported programs behind one callable that returns a tuple.

    A thin layer over :func:`cadence_fx.runtime.catalog.reference`: the call picks ``ep.module()``
    by the exact input signature (a miss raises :class:`cadence_fx.runtime.catalog.CatalogMiss`)
    and runs it under ``no_grad``.
    """

    def __init__(self, eps: Sequence[ExportedProgram]) -> None:
        self._call = reference(eps)
        self.catalog: Catalog = self._call.catalog

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self._call(*args))


def run_stream(program: Callable[..., Sequence[torch.Tensor]], step: StreamingStep, state: Mapping[str, torch.Tensor],
               fresh: Sequence[Mapping[str, torch.Tensor]], *,
               restore: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
               on_call: Callable[[int, Sequence[torch.Tensor]], None] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Drive ``program`` (the eager step, a stock driver's call, a :class:`CatalogReference` or an
    optimized program) through ``len(fresh)`` calls, feeding each call's state outputs back as they are.

    ``restore`` maps a call index to a state snapshot that replaces the carried state before
    that call (a turn-boundary restore: foreign tensors). ``on_call(k, outputs)`` sees the raw
    outputs before they are cloned. Returns every call's outputs, cloned as a consumer reads them.
    """
    st = dict(state)
    outs = []
    for k, f in enumerate(fresh):
        if restore and k in restore:
            st = {name: t.clone() for name, t in restore[k].items()}
        with torch.no_grad():
            raw = program(*step.next_args(f, st))
        if on_call is not None:
            on_call(k, raw)
        outs.append(tuple(t.clone() for t in raw))
        st = step.carry(raw)
    return outs
