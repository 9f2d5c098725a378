"""Calls are transactions for the state: a call that raises leaves every region as it was before it.

A region's bytes change in place inside a call (the rewritten cat, the retention compaction, a ring
write), so an exception after the first such write (an out-of-range token id inside an embedding,
an out-of-memory error, a ``KeyboardInterrupt`` from a signal or a hook) would otherwise leave a
state that is neither the old one nor the new one, and feeding it back gives wrong bytes.

- A session's call runs on a lane's buffers, which are scratch for it; the session's own buffers
  change only at the commit, which is one ``_foreach_copy_`` (one operator: it runs whole or not at
  all) with signal handlers deferred around it, so the commit cannot be cut in half.
- The default program keeps its state in lane 0's buffers between calls (no copies), so the call
  writes the state itself. :class:`UndoLog` copies the state the last call returned before the call
  touches it, and puts it back if the call raises; the copy is dropped when the call succeeds.

Random streams are part of the state too: a failed call's draws are undone with its regions.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch

__all__ = ["UndoLog", "commit_copies", "deferred_signals"]


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
