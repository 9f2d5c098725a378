"""Moshi's streaming state as explicit tensors: what one step reads and writes across frames.

moshi keeps its streaming state in ``_streaming_state`` dataclasses on each ``StreamingModule``
(``moshi/modules/streaming.py``), set up by ``module.streaming(batch_size)`` and mutated by every
call: the ring KV caches (``RingKVCache.cache``, written with ``scatter_`` / ``index_copy_`` at
``end_offset % capacity``), position counters, the LM's delayed-token cache, the causal convs' left
context and the transposed convs' overlap. ``torch.export`` sees none of that: tensors reached
through Python objects become constants of the program. So the steps take the state as inputs and
return it as outputs, and :func:`state_slots` says where each tensor lives in the upstream objects:
a step installs the tensors passed in (:meth:`StateSlot.set`), runs the upstream code unchanged,
and reads them back (:meth:`StateSlot.get`), whether the upstream code wrote them in place (the
rings, ``previous[:] = ...``) or replaced them (``state.offsets = torch.where(...)``).

Only the fields of the state classes listed here are read; a state object of another class that
holds a tensor (cross-attention caches, a newer moshi's fields) is refused with
:class:`UnsupportedState` rather than left as a constant the program would silently freeze.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

__all__ = ["StateSlot", "UnsupportedState", "read_state", "state_slots", "write_state"]


class UnsupportedState(RuntimeError):
    """A streaming state field the adapter does not know how to carry between calls."""


@dataclass(frozen=True)
class StateSlot:
    """One state tensor of a streaming module.

    Attributes:
        name: ``<module path>.<field>`` under the module :func:`state_slots` was given, e.g.
            ``lm_model.transformer.layers.3.self_attn.kv_cache``.
        module: the streaming module's path.
        field: what it holds: ``kv_cache`` (``(2, B, heads, capacity, head_dim)``, the ring),
            ``end_offset`` (the ring's write counter), ``offset`` / ``offsets`` (position counters),
            ``tokens`` (the LM's delayed-token ring), ``previous`` (a causal conv's left context),
            ``first`` (a replicate-padded conv's first-call flag), ``partial`` (a transposed conv's
            overlap).
        get: reads the tensor from the module's current streaming state.
        set: installs a tensor in the module's current streaming state.
    """

    name: str
    module: str
    field: str
    get: Callable[[], torch.Tensor]
    set: Callable[[torch.Tensor], None]


def _attr(obj: object, attr: str) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    return (lambda: getattr(obj, attr)), (lambda t: setattr(obj, attr, t))


def state_slots(root: nn.Module, up: types.SimpleNamespace, *,
                prefixes: Iterable[str] | None = None) -> list[StateSlot]:
    """The state tensors of ``root``'s streaming modules (``root`` must be streaming), in module order.

    Args:
        root: a moshi ``StreamingModule`` in streaming mode (``root.streaming(batch_size)`` entered).
            Its detached children (``LMGen.lm_model``, which ``LMGen`` streams itself) are included
            when they are streaming; the depformer, which ``LMGen`` re-enters streaming for on
            every frame, holds no state across frames and is skipped.
        up: the loaded upstream modules (:func:`cadence_fx.adapters.moshi.load_moshi`).
        prefixes: keep only modules whose path starts with one of these (``None``: all), e.g. the
            decoder side of Mimi for its decode step.

    Raises:
        UnsupportedState: a state object holds a tensor this adapter does not recognise.
    """
    tr, conv, lm, streaming = up.transformer, up.conv, up.lm, up.streaming
    keep = tuple(prefixes) if prefixes is not None else None
    slots: list[StateSlot] = []
    for path, mod in root.named_modules():
        if not isinstance(mod, streaming.StreamingModule) or mod._streaming_state is None:
            continue
        if keep is not None and not path.startswith(keep):
            continue
        st = mod._streaming_state
        found: list[tuple[str, object, str]] = []
        if isinstance(st, tr._MHAState):
            if st.k_cross is not None or st.v_cross is not None:
                raise UnsupportedState(f"{path}: cross-attention caches are not carried by the adapter")
            found.append(("offset", st, "offset"))
            if st.kv_cache is not None:
                found += [("kv_cache", st.kv_cache, "cache"), ("end_offset", st.kv_cache, "end_offset")]
        elif isinstance(st, tr._TransformerState):
            found.append(("offsets", st, "offsets"))
        elif isinstance(st, lm._LMGenState):
            found += [("tokens", st, "cache"), ("offsets", st, "offsets")]
        elif isinstance(st, conv._StreamingConv1dState):
            if st.previous.shape[-1] > 0:
                found.append(("previous", st, "previous"))
            if mod.pad_mode == "replicate":  # the only mode that reads and rewrites ``first``
                found.append(("first", st, "first"))
        elif isinstance(st, conv._StreamingConvTr1dState):
            if st.partial.shape[-1] > 0:
                found.append(("partial", st, "partial"))
        elif type(st) in (tr._LayerState, streaming.State, up.compression._MimiState):
            pass  # Python counters and CUDAGraphed wrappers only
        else:
            _refuse_tensors(path, st)
        for field, owner, attr in found:
            get, put = _attr(owner, attr)
            slots.append(StateSlot(f"{path}.{field}" if path else field, path, field, get, put))
    return slots


def _refuse_tensors(path: str, st: object) -> None:
    if dataclasses.is_dataclass(st):
        for f in dataclasses.fields(st):
            if isinstance(getattr(st, f.name), torch.Tensor):
                raise UnsupportedState(f"{path or '<root>'}: streaming state {type(st).__name__}.{f.name} is a tensor "
                                       "the moshi adapter does not carry between calls")


def read_state(slots: Iterable[StateSlot]) -> dict[str, torch.Tensor]:
    """The current state tensors by slot name (the module's own tensors, not copies)."""
    return {s.name: s.get() for s in slots}


def write_state(slots: Iterable[StateSlot], state: dict[str, torch.Tensor]) -> None:
    """Install ``state`` (by slot name) into the modules' streaming states; every slot must be given."""
    slots = list(slots)
    missing = [s.name for s in slots if s.name not in state]
    if missing:
        raise KeyError(f"state for {len(missing)} slot(s) missing, e.g. {missing[:3]}")
    for s in slots:
        s.set(state[s.name])
