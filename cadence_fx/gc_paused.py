"""Python's cyclic garbage collector paused around building a program (:func:`cyclic_gc_paused`).

Building lanes (the passes, lane copies, an artifact's decoded graphs) makes tens of thousands of
objects that live on: graph nodes, modules, generated code. Every few hundred allocations the
collector walks every tracked object of the younger generations again, and the objects that
survive are promoted and walked again later, for nothing: none of it is garbage. On the CPU that was
a fifth of ``cf.optimize(lanes=8)`` and of an 8-lane ``cf.load`` (docs/benchmarks.md, session 25).
Reference counting still frees whatever dies inside the block; cycles made there are collected once
the collector runs again.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["cyclic_gc_paused"]


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic collector off for the block, and after it as it was before (also when the block
    raises). Nested and concurrent uses are safe: only the use that turned it off turns it on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
