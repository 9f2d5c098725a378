"""Calls are transactions for the state: a call that raises leaves every region as it was before it.

A region's bytes change in place inside a call (the rewritten cat, the retention compaction, a ring
write), so an exception after the first such write (an out-of-range token id inside an embedding,
an out-of-memory error, a ``KeyboardInterrupt`` from a signal or a hook) would otherwise leave a
state that is neither the old one nor the new one, and feeding it back gives wrong bytes.

- A session's call runs on a lane's buffers, which are scratch for it; the session's own buffers
  change only at the commit, which is one ``_foreach_copy_`` (one operator: it runs whole or not at
  all) with signal handlers deferred around it, so the commit cannot be cut in half.
- The default program keeps its state in lane 0's buffers between calls (no copies), and a pinned
  session in its own lane's, so the call writes the state itself. :class:`CallUndo` undoes such a
  call: the journal (:mod:`cadence_fx.runtime.journal`) puts back what each of its writes
  overwrote, and :class:`UndoLog` copies, before the call, the regions the journal does not cover
  (a write it cannot replay, a state copied in over the resident one, module tensors carried between
  calls) and puts them back if the call raises; both are dropped when the call succeeds.

Random streams are part of the state too: a failed call's draws are undone with its regions.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch

from cadence_fx.runtime.journal import WriteJournal, journal_arm, journal_nbytes, journal_rollback

__all__ = ["CallUndo", "UndoLog", "commit_copies", "deferred_signals", "whole_undo"]


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold back SIGINT (and SIGTERM where Python handles it) for the block, then deliver it.

    Python raises a signal's exception only in the main thread, between two bytecodes. A commit is a
    few bytecodes (one copy operator and a dict assignment); a ``KeyboardInterrupt`` between them would
    leave new bytes under old bookkeeping. Off the main thread no signal can interrupt the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):  # a Python handler (the default SIGINT one raises KeyboardInterrupt)
            previous[sig] = signal.signal(sig, lambda s, _frame: caught.append(s))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in caught:
            signal.raise_signal(sig)  # delivered now, after the commit: the call has taken effect


def commit_copies(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, as one operator (all of them or none)."""
    if not dsts:
        return
    with torch.no_grad():
        torch._foreach_copy_(list(dsts), list(srcs))


class UndoLog:
    """The bytes a call may overwrite in place, copied before it; put back if it raises.

    ``views`` are the tensors whose bytes are the state before the call: the views of the region
    buffers the last call returned, and module tensors the programs write in place that carry a value
    from call to call. The copies are made on the current stream, before anything of the call runs.
    """

    def __init__(self, views: Mapping[str, torch.Tensor]) -> None:
        self._views = dict(views)
        with torch.no_grad():
            self._saved = {name: v.clone() for name, v in self._views.items()}

    def rollback(self) -> None:
        """Put every saved byte back (with signals deferred: a rollback cut in half is no rollback)."""
        names = list(self._views)
        with deferred_signals():
            commit_copies([self._views[n] for n in names], [self._saved[n] for n in names])
        self._saved.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._saved.values())


def whole_undo(journal: WriteJournal | None, returned: Mapping[str, torch.Tensor],
               copied_in: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The views of ``returned`` (the state before the call, by region) an undo must copy whole: every
    region without a journal; with one, the regions it could not journal and those ``copied_in`` (a
    state given from elsewhere is copied over the resident bytes before the graph runs)."""
    if journal is None:
        return dict(returned)
    keep = journal.whole | set(copied_in)
    return {n: v for n, v in returned.items() if n in keep}


class CallUndo:
    """The undo of one call that writes the state where it lives: the journal's entries, then the
    whole copies of ``views``. Arm it (this constructor) before anything of the call runs; set
    :attr:`inputs` (each region's state input, as the graph is given it) and :attr:`buffers` (the
    lane's flat region buffers) before the graph runs."""

    def __init__(self, gm: torch.nn.Module, journal: WriteJournal | None, views: Mapping[str, torch.Tensor]) -> None:
        self._gm, self._journal = gm, journal
        self._log = UndoLog(views)
        self.inputs: dict[str, torch.Tensor] = {}
        self.buffers: Mapping[str, torch.Tensor] = {}
        journal_arm(gm, journal)

    def rollback(self) -> None:
        """Put the state back as it was before the call (signals deferred: half a rollback is none)."""
        with deferred_signals():
            if self._journal is not None and self.inputs:
                journal_rollback(self._gm, self._journal, self.inputs, self.buffers)
            self._log.rollback()

    def nbytes(self) -> int:
        """Bytes this undo saved: the whole copies and the journal's buffers."""
        return self._log.nbytes() + journal_nbytes(self._gm, self._journal)
