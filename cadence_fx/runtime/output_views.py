"""What a replayed graph's outputs hand back: the same aliasing as the eager run.

An eager run of a partition can return a view of memory that outlives the call: a buffer the
partition holds (a region bound as an attribute, a cache in a module buffer), an argument it uses in
place, or an argument it only reads. A later partition, or the caller, may then write into that view
in place, and the write must reach the memory the view is of. The graph's own outputs are its static
buffers, overwritten by the next replay, so they are cloned for the caller; a clone of a view breaks
the aliasing, and the later write lands in the clone (what a journal node between a region's view
and its write, in another partition, once showed as other bytes).

So each output of a captured class is classified once, at capture, by the storage it views:

- ``KEEP``: a storage that outlives the replay at a fixed address (an attribute of the partition, an
  argument used in place): returned as-is, as the eager run returns it.
- ``(i, offset)``: the static staging buffer of read-only argument ``i`` (staging keeps the
  argument's shape, strides and alignment): returned as the same view of the caller's argument
  ``i``, ``offset`` elements from its first one.
- ``CLONE``: memory of the graph's own (an intermediate): cloned, as before.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from cadence_fx.runtime.staging import span_of

__all__ = ["CLONE", "KEEP", "OutputPlan", "held_storages", "hand_out", "plan_outputs", "storage_ptr"]

KEEP = "keep"
CLONE = "clone"
OutputPlan = Union[str, tuple[int, int]]


def storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (0 for none): what two views of one buffer share."""
    return t.untyped_storage().data_ptr()


def held_storages(fn: Any) -> frozenset[int]:
    """Storage pointers of every tensor ``fn`` holds: parameters, buffers and tensor attributes of each
    of its modules (a partition's bound regions and constants). Empty for a callable that is no module."""
    if not isinstance(fn, torch.nn.Module):
        return frozenset()
    out: set[int] = set()
    for m in fn.modules():
        tensors = [*m._parameters.values(), *m._buffers.values(),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
        out.update(storage_ptr(t) for t in tensors if t is not None)
    out.discard(0)
    return frozenset(out)


def plan_outputs(static_outputs: Sequence[torch.Tensor | None], static_args: Sequence[object],
                 staged: Sequence[int], persistent: frozenset[int]) -> tuple[OutputPlan, ...]:
    """Each static output's plan (see the module's docstring). ``staged``: the argument positions
    copied into static buffers; ``persistent``: the storages that outlive a replay.

    Raises ``ValueError`` for an output inside a staging buffer that is no view of one argument of
    the same dtype (an ``as_strided`` past it, a dtype view): it could not be handed back as eager
    hands it, so the class is not captured."""
    plans: list[OutputPlan] = []
    for o in static_outputs:
        if o is None:
            plans.append(CLONE)
            continue
        sp = storage_ptr(o)
        if sp in persistent:
            plans.append(KEEP)
            continue
        plan: OutputPlan = CLONE
        in_staging = False
        for i in staged:
            s = static_args[i]
            assert isinstance(s, torch.Tensor)
            if storage_ptr(s) != sp:
                continue
            in_staging = True
            lo, hi = s.data_ptr(), s.data_ptr() + span_of(s) * s.element_size()
            if not (lo <= o.data_ptr() and o.data_ptr() + span_of(o) * o.element_size() <= hi):
                continue  # another argument's bytes in the same arena
            delta = o.data_ptr() - lo
            if o.dtype != s.dtype or delta % s.element_size():
                raise ValueError(f"output of shape {tuple(o.shape)} views staged argument {i} as {o.dtype} "
                                 f"(argument: {s.dtype}): no view of the caller's argument gives it")
            plan = (i, delta // s.element_size())
            break
        if plan == CLONE and in_staging:
            raise ValueError(f"output of shape {tuple(o.shape)} lies in a staging buffer outside every "
                             "argument staged there")
        plans.append(plan)
    return tuple(plans)


def hand_out(static_outputs: Sequence[torch.Tensor | None], plans: Sequence[OutputPlan],
             args: Sequence[Any], clone: bool) -> list[torch.Tensor | None]:
    """The outputs of one replay as the caller gets them (``clone``: the engine clones its own memory)."""
    outs: list[torch.Tensor | None] = []
    for o, plan in zip(static_outputs, plans):
        if o is None or plan == KEEP:
            outs.append(o)
        elif plan == CLONE:
            outs.append(o.clone() if clone else o)
        else:
            i, offset = plan  # type: ignore[misc]
            a = args[i]
            outs.append(a.as_strided(o.shape, o.stride(), a.storage_offset() + offset))
    return outs
