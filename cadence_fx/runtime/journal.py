"""The undo journal at run time: arm it before a call, walk it back if the call raises.

:mod:`cadence_fx.passes.journal_writes` puts, before each write into a region's bytes, a save of the
elements that write overwrites (inside the graphs, into small buffers of the lane's own) and a flag
set once they are saved. The runtime zeroes the flags before a call it may have to undo
(:func:`journal_arm`) and, if the call raises, puts back every saved entry whose flag is set, last
first (:func:`journal_rollback`): each region's bytes are then those before the call. An entry whose
write never ran has its flag clear and puts nothing back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["JournalEntry", "WriteJournal", "find_attr", "journal_arm", "journal_nbytes", "journal_rollback"]


@dataclass(frozen=True)
class JournalEntry:
    """One journaled write: where its destination is, and where its overwritten bytes were saved."""

    region: str
    root: str  # "input": the call's state input of the region; "buffer": the region's flat buffer
    chain: tuple[tuple[Any, tuple, tuple], ...]  # view ops from the root: (op, args after the tensor, kwargs items)
    kind: str  # "view": the whole destination; "scatter_" / "index_copy_" / "index_fill_": indexed elements
    dim: int | None
    old: str  # attribute of the saved bytes
    index: str | None  # attribute of the saved index (indexed kinds)
    slot: int  # element of the flags buffer set once the bytes are saved



@dataclass(frozen=True)
class WriteJournal:
    """What a call of one program writes into its regions, journaled; ``whole``: the regions it could not."""

    flags: str | None
    entries: tuple[JournalEntry, ...]
    whole: frozenset[str]

    def written(self) -> frozenset[str]:
        return frozenset(e.region for e in self.entries) | self.whole


def find_attr(gm: torch.nn.Module, attr: str) -> torch.Tensor:
    """The tensor a program's modules hold under ``attr``: the root's, else the first submodule's that
    has it (privatising gives every module of one lane that lane's one copy)."""
    for mod in gm.modules():
        t = mod._buffers.get(attr)
        if t is None:
            t = vars(mod).get(attr)
        if isinstance(t, torch.Tensor):
            return t
    raise KeyError(f"no module of the program holds journal buffer {attr!r}")


# each program's flags buffer, found once: arming runs before every call, and a lane's programs are
# fixed once built (the walk over a 7B LM's modules would be host time on every frame)
_FLAGS: "weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def journal_arm(gm: torch.nn.Module, journal: WriteJournal | None) -> None:
    """Before a call that may be undone: no entry is done yet."""
    if journal is None or journal.flags is None:
        return
    flags = _FLAGS.get(gm)
    if flags is None:
        flags = _FLAGS[gm] = find_attr(gm, journal.flags)
    flags.zero_()


def journal_rollback(gm: torch.nn.Module, journal: WriteJournal, inputs: Mapping[str, torch.Tensor],
                     buffers: Mapping[str, torch.Tensor]) -> None:
    """Put back, last first, the bytes every done entry saved. ``inputs``: the call's state input of each
    region (the views the graph was given); ``buffers``: the lane's flat region buffers."""
    if journal.flags is None:
        return
    flags = find_attr(gm, journal.flags)
    with torch.no_grad():
        for e in reversed(journal.entries):
            v = inputs[e.region] if e.root == "input" else buffers[e.region]
            for op, args, kwargs in e.chain:
                v = op(v, *args, **dict(kwargs))
            old, flag = find_attr(gm, e.old), flags[e.slot]
            if e.kind == "view":
                v.copy_(torch.where(flag, old, v))
                continue
            idx = find_attr(gm, e.index)
            if e.kind == "scatter_":
                v.scatter_(e.dim, idx, torch.where(flag, old, v.gather(e.dim, idx)))
            else:
                v.index_copy_(e.dim, idx, torch.where(flag, old, v.index_select(e.dim, idx)))


def journal_nbytes(gm: torch.nn.Module, journal: WriteJournal | None) -> int:
    """Bytes one call saves into the journal (the undo's traffic, besides the regions copied whole)."""
    if journal is None:
        return 0
    total = 0
    for e in journal.entries:
        for attr in (e.old, e.index):
            if attr is not None:
                t = find_attr(gm, attr)
                total += t.numel() * t.element_size()
    return total
