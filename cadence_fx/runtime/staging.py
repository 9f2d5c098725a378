"""Staging: the static buffers a captured graph reads its non-aliased arguments from.

A graph binds addresses, so an argument that is not a contract-owned buffer is copied into a static
buffer of the same shape, strides, dtype and pointer alignment before each replay. The engines of one
lane share one :class:`StagingArena`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["ALIGN", "Stage", "StagingArena", "span_of", "staging_buffer"]

ALIGN = 16  # kernels (vectorized loads, cuBLAS) pick paths by pointer alignment up to 16 bytes


@dataclass
class Stage:
    """Copies one argument into its static buffer. Arguments with a zero stride
    (expanded) cannot be written elementwise, so their whole storage span is copied."""

    index: int
    dst: torch.Tensor
    span: int | None  # element count of the span to copy, or None for a plain copy_

    def load(self, src: torch.Tensor) -> None:
        if self.span is None:
            self.dst.copy_(src)
        else:
            self.dst.copy_(src.as_strided((self.span,), (1,), src.storage_offset()))


class StagingArena:
    """Device memory that the staged arguments of a set of engines share (the runners of one lane).

    The engines of one lane replay one at a time, in the order of one stream. Every replay loads its
    staged arguments just before it runs, and the outputs that view them are handed back as views of
    the callers' arguments (:mod:`cadence_fx.runtime.output_views`), never of the arena. So their classes can stage into the same bytes: the lane holds the largest class's
    staging, not the sum over every class of every engine. (Without the state rule, a solver's history
    passed to each of ten step graphs was staged once per graph.)

    One class's arguments are packed side by side, never overlapping. A class that needs more than
    the arena holds gets a new, larger arena; the graphs captured on the old one keep it alive, and
    :attr:`allocated` counts both.
    """

    _GRAIN = 64  # bytes between one argument and the next; the pointer alignment inside is the argument's own

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self.allocated = 0

    def place(self, tensors: Sequence[tuple[int, torch.Tensor]]) -> tuple[list[tuple[torch.Tensor, Stage]], int]:
        """Static buffers for one class's staged arguments ``(position, tensor)``; returns them and the bytes
        this call newly allocated."""
        layout, end = [], {}
        for i, t in tensors:
            extent, shift = span_of(t), (t.data_ptr() % ALIGN) // t.element_size()
            start = -(-end.get(t.device, 0) // self._GRAIN) * self._GRAIN
            layout.append((i, t, start, extent, shift))
            end[t.device] = start + (extent + shift) * t.element_size()
        grown = 0
        for dev, need in end.items():
            buf = self._buffers.get(dev)
            if buf is None or buf.numel() < need:
                self._buffers[dev] = torch.empty(need, dtype=torch.uint8, device=dev)
                grown += need
        self.allocated += grown
        placed = []
        for i, t, start, extent, shift in layout:
            nbytes = (extent + shift) * t.element_size()
            flat = self._buffers[t.device][start:start + nbytes].view(t.dtype)
            placed.append(_static_view(i, t, flat, extent, shift))
        return placed, grown


def span_of(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last, through its strides."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _static_view(index: int, t: torch.Tensor, flat: torch.Tensor, extent: int, shift: int
                 ) -> tuple[torch.Tensor, Stage]:
    static = flat.as_strided(t.shape, t.stride(), flat.storage_offset() + shift)
    if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
        return static, Stage(index, flat[shift:], extent)
    return static, Stage(index, static, None)


def staging_buffer(index: int, t: torch.Tensor) -> tuple[torch.Tensor, Stage]:
    """A buffer of its own with the shape, strides, dtype, device and pointer alignment of ``t``."""
    extent, shift = span_of(t), (t.data_ptr() % ALIGN) // t.element_size()
    return _static_view(index, t, torch.empty(extent + shift, dtype=t.dtype, device=t.device), extent, shift)
