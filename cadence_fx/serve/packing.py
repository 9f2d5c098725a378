"""A conversation's regions packed into one flat byte buffer: one copy off the session, one transfer.

A session's regions are many tensors, some of them strided views of larger buffers (a state in the
envelope layout). Copied one by one to the host, each strided region is a loop of small synchronous
copies into pageable memory; pickled one by one, each is its own object. Packed first, on the
region's own device, the state is one contiguous allocation: one device-to-device copy per region
(strides resolved where the bandwidth is), then one transfer of the whole (into pinned host memory
for a checkpoint or a move through the object store, or shared in place with another process on
the same GPU: :mod:`cadence_fx.serve.handoff`).

:class:`PackLayout` says where each region sits in the buffer (name, dtype, shape, byte offset); the
offsets are aligned so every region's view has its dtype's alignment. :func:`pack` and :func:`unpack`
keep every bit: a region comes back with its dtype, shape and bytes (contiguous).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from cadence_fx.runtime.state import copy_state

__all__ = ["ALIGN", "PackLayout", "pack", "reserve_pinned", "to_host", "unpack"]

ALIGN = 256  # bytes: every region starts at a multiple (a CUDA allocation's alignment; any dtype's)


@dataclass(frozen=True)
class PackLayout:
    """Where each region sits in a packed buffer: ``(name, dtype, shape, offset)``; ``nbytes`` in all."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> "PackLayout":
        entries, offset = [], 0
        for name, t in state.items():
            entries.append((name, t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def region_bytes(self) -> int:
        """Bytes of the regions themselves (the buffer less its alignment padding)."""
        return sum(math.prod(shape) * dtype.itemsize for _n, dtype, shape, _o in self.entries)


def unpack(flat: torch.Tensor, layout: PackLayout) -> dict[str, torch.Tensor]:
    """Each region as a view of ``flat`` (a uint8 buffer of ``layout.nbytes``), by name."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < layout.nbytes:
        raise ValueError(f"a packed state is a flat uint8 buffer of at least {layout.nbytes} bytes; got "
                         f"{flat.dtype} of shape {tuple(flat.shape)}")
    out = {}
    for name, dtype, shape, offset in layout.entries:
        out[name] = flat[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
    return out


def pack(state: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> tuple[torch.Tensor, PackLayout]:
    """``state`` copied into one new flat buffer on ``device`` (default: the first region's), and its layout."""
    layout = PackLayout.of(state)
    if device is None:
        device = next(iter(state.values())).device if state else "cpu"
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for name, view in unpack(flat, layout).items():
            copy_state(view, state[name])
    return flat, layout


def reserve_pinned(nbytes: int) -> int | None:
    """Leave a pinned host block of ``nbytes`` in PyTorch's caching host allocator, so that the first
    export of that size pays only for its copy, not for pinning the memory (page-locking a GiB takes a
    fraction of a second: the first move or checkpoint of a worker was its slowest). Call it after the
    captures (a capture empties the host cache). Returns the block's address (``None`` without CUDA)."""
    if nbytes <= 0 or not torch.cuda.is_available():
        return None
    block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    ptr = block.data_ptr()
    del block  # back to the cache, kept for the next pinned allocation of its size
    return ptr


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """A packed buffer on the host: itself if it is there, else one copy into pinned memory (the
    caching host allocator reuses the block for the next export of the same size), waited for."""
    if flat.device.type == "cpu":
        return flat
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return host
