"""The contracts of the Moshi steps, derived from their state slots.

One clock, ``frame`` (80 ms, stride 1: every call is one frame). Every state tensor is a region
whose extent never changes, so each is a :class:`~cadence_fx.Ring`:

- ``kv_cache`` ``(2, B, heads, capacity, head_dim)``: the ring KV cache, written in place at
  ``end_offset % capacity`` (``scatter_`` on ``cache[0]`` / ``cache[1]``) and read whole with a
  position mask: ``Ring(capacity)`` on axis 3, ``order=None`` (never concatenated).
- ``tokens`` ``(B, 1 + n_q, max_delay + 2)``: ``LMGen``'s delayed-token ring, written with
  ``scatter_`` and read with ``gather``: ``Ring`` on axis 2, ``order=None``.
- counters (``offset``, ``offsets``, ``end_offset``, ``first``): recurrent state, a ``Ring`` over the
  batch axis, ``order=None``.
- ``previous`` ``(B, C, k - s)``: a causal conv's left context, ``cat([previous, x], -1)`` then the
  last ``k - s`` samples written back into it: ``Ring(k - s)`` on axis 2, ``order="old_new"``.
- ``partial`` ``(B, C, k - s)``: a transposed conv's overlap, added into the next output and
  overwritten: ``Ring(k - s)`` on axis 2, ``order=None``.

Every region starts full (``initial`` = capacity): upstream allocates the whole ring at
``streaming()`` and masks what was never written by position.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cadence_fx.adapters.moshi.state import StateSlot
from cadence_fx.adapters.moshi.steps import LMStep, MoshiStep
from cadence_fx.contract import WHOLE_STEP, Clock, Contract, Region, Ring

__all__ = ["FRAME", "moshi_contract", "slot_region"]

#: Moshi's one clock: 12.5 Hz frames (1920 samples at 24 kHz), one per call.
FRAME = Clock("frame", 1, "80 ms frames")

# field -> (clock axis, order)
_LAYOUT = {
    "kv_cache": (3, None),
    "tokens": (2, None),
    "previous": (2, "old_new"),
    "partial": (2, None),
    "offset": (0, None),
    "offsets": (0, None),
    "end_offset": (0, None),
    "first": (0, None),
}


def slot_region(slot: StateSlot, input_name: str, output: int, *, replicate: bool = False) -> Region:
    """The region of one state slot carried by input ``input_name`` and output ``output``.

    ``replicate``: the slot is the left context of a conv with ``pad_mode="replicate"`` (Mimi's
    downsampler). That conv first writes the context in place (``previous[:] = where(first, x[..., :1],
    previous)``) and then concatenates the written tensor; ``carry_writeback`` looks for a ``cat`` of
    the region input itself and does not follow the in-place write's result, so the region is
    declared as a ring written in place (``order=None``), which is what the pass then checks.
    """
    if slot.field not in _LAYOUT:
        raise ValueError(f"no region layout for state field {slot.field!r} ({slot.name})")
    axis, order = _LAYOUT[slot.field]
    if replicate:
        order = None
    capacity = int(slot.get().shape[axis])
    return Region(slot.name, input=input_name, output=output, clock=FRAME.name, axis=axis, order=order,
                  retention=Ring(capacity), initial=capacity)


def moshi_contract(step: MoshiStep, *, wrap: Sequence[str] = (WHOLE_STEP,),
                   fields: Sequence[str] | None = None, hoist_constants: bool | None = None,
                   fold_weights: bool | None = None) -> Contract:
    """The contract of ``step`` (an :class:`~cadence_fx.adapters.moshi.LMStep`,
    :class:`~cadence_fx.adapters.moshi.MimiDecodeStep` or :class:`~cadence_fx.adapters.moshi.MimiEncodeStep`).

    Args:
        step: the step; its slots give the regions (input ``state_i``, output ``1 + i``).
        wrap: the replayed callables; by default the whole step is one graph (an LM frame is one
            replay, sampling included, where the vendor replays ``forward_text`` and
            ``depformer_step`` as two graphs with eager glue between them).
        fields: declare only the slots of these fields as regions (``None``: every slot); the
            others stay plain inputs and outputs of the program.
        hoist_constants: ``Contract.hoist_constants``. ``None``: off for the LM step, on for Mimi.
            The depformer allocates its ring and write counter fresh every frame
            (``torch.zeros`` in ``RingKVCache.__init__``) and writes them in place
            (``end_offset.add_``); the ``hoist_constants`` pass hoists such a factory into one
            buffer computed once, so the next frame would start from the last frame's counter
            (``WeightsChanged`` is raised). Until that pass leaves factories written in place
            alone, the LM step runs without hoisting (its constant cones, RoPE frequencies and the
            like, are a few small kernels inside the replayed graph).
        fold_weights: ``Contract.fold_weights`` (``None``: the contract's default, on; it acts only
            with ``hoist_constants``). ``hoist_constants=False, fold_weights=False`` runs Mimi's
            weight norm and constant cones inline every call, as the stock code does (the ``Snh``
            cell of ``benchmarks/moshi.py``).
    """
    regions = []
    for name, out in step.state.items():
        slot = step.slot_of(name)
        if slot.get().dtype == torch.bool:
            # ``cadence_fx.plan`` sizes buffers with torch.iinfo, which has no bool: the downsampler's
            # one-element first-call flag stays a plain input and output of the program
            continue
        if fields is None or slot.field in fields:
            pad_mode = getattr(step.module.get_submodule(slot.module), "pad_mode", None) if slot.module else None
            regions.append(slot_region(slot, name, out, replicate=pad_mode == "replicate"))
    if hoist_constants is None:
        hoist_constants = not isinstance(step, LMStep)
    extra = {} if fold_weights is None else {"fold_weights": fold_weights}
    return Contract(clocks=(FRAME,), regions=tuple(regions), wrap=tuple(wrap), hoist_constants=hoist_constants,
                    **extra)
