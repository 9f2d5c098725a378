"""State the step keeps in its own module buffers: a cache registered with ``register_buffer`` and
written in place, which the caller never passes and so the stream cannot show being fed back.

The graph says which buffers are written and whether a call reads what an earlier call left there
(:func:`~cadence_fx.analysis.writes.attribute_writes`): a buffer written before it is read every
call is scratch, not state. The eager replay adds the values: the positions each call changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from cadence_fx.contract import Ring
from cadence_fx.proposal.graph_facts import WriteFact, placeholder, writes_of
from cadence_fx.proposal.observe import changed_positions


@dataclass(frozen=True)
class BufferRegion:
    """The fields of a proposed ``Region(input=<buffer>, output=None)``, short of its clock."""

    fqn: str
    axis: int
    capacity: int
    growth: int | None

    def fields(self, name: str, clock: str, growth: int | None) -> dict[str, Any]:
        return dict(name=name, input=self.fqn, output=None, clock=clock, axis=self.axis, order=None,
                    retention=Ring(self.capacity), initial=self.capacity, growth=growth)


def buffer_region(fqn: str, ph: Node, writes: Sequence[WriteFact], carried: bool | None,
                  values: Sequence[torch.Tensor]) -> tuple[BufferRegion | None, list[str]]:
    """The region of one written module buffer (None for scratch) and the evidence for it.

    ``values``: the buffer before each observed call, then after the last."""
    ev: list[str] = []
    nodes = ", ".join(f"{w.node!r} (aten.{w.op})" for w in writes) or "a buffer mutation export returns"
    if carried is False:
        ev.append(f"module buffer {fqn!r} is written by graph node(s) {nodes} before any read in every call: "
                  "scratch, not state; no region proposed for it")
        return None, ev
    ev.append(f"module buffer {fqn!r} is written in place by graph node(s) {nodes} and a call reads what the one "
              f"before left in it{'' if carried else ' (assumed: the graph does not say)'}: state the program "
              "keeps itself (graph_signature input "
              f"{ph.name!r}); proposed as Region(input={fqn!r}, output=None)")
    shape = tuple(values[0].shape) if values else tuple(ph.meta["val"].shape)
    along = next((w for w in writes if w.dim is not None), None)
    axis = along.dim if along is not None and along.dim is not None else len(shape) - 1
    ev.append(f"axis {axis}: the dim graph node {along.node!r} writes positions along" if along is not None else
              f"axis {axis}: no write names positions along a dim; the last dim is taken")
    counts = [w.count for w in writes if w.dim == axis and w.count]
    growth = sum(counts) if counts else None
    changed = [changed_positions(a, b, axis) for a, b in zip(values, values[1:])]
    shown = "; ".join(f"call {k}: {ch}" for k, ch in enumerate(changed[:4]))
    over = [k for k, ch in enumerate(changed) if growth is not None and len(ch) > growth]
    ev.append(f"retention Ring({shape[axis]}), order None: the buffer's extent along dim {axis} is {shape[axis]}; "
              f"{growth if growth is not None else 'an unknown number of'} positions written a call; checked by "
              f"values over the eager replay, positions changed per call: {shown}"
              f"{'; ...' if len(changed) > 4 else ''}"
              + (f"; more positions than the writes name changed at calls {over}" if over else ""))
    still = [k for k, ch in enumerate(changed) if not ch]
    if growth and still:
        ev.append(f"no position of it changed at calls {still}: the buffer held the written values already (were "
                  "the calls recorded on this very step? Its buffers must be as they were at the stream's first "
                  "call; record on a copy of the step); the values confirm nothing there")
    return BufferRegion(fqn, axis, int(shape[axis]), growth), ev


def lifted_buffers(ep: ExportedProgram, step: torch.nn.Module) -> dict[str, str]:
    """Module buffers of ``step`` that ``ep`` took as lifted constants and writes (placeholder -> buffer
    name): a non-strict trace reaches them through an object and does not see they are the buffers."""
    own = {id(b): name for name, b in step.named_buffers(remove_duplicate=False)}
    found = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.CONSTANT_TENSOR or spec.target is None:
            continue
        fqn = own.get(id(ep.constants.get(spec.target)))
        ph = placeholder(ep, spec.arg.name)
        if fqn is not None and ph is not None and writes_of(ep, ph):
            found[spec.arg.name] = fqn
    return found
