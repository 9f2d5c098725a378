"""The state store: the region buffers and workspaces an optimized program owns across calls.

Each region lives in one contract-owned flat buffer at a stable address. A call's state output is
a view of that buffer, and the next call overwrites it in place. So the store knows, per region,
which tensor the last call returned: fed back as it is, it is used in place; any other tensor is
copied in (a snapshot restored at a turn boundary, the prompt's state); and a view of the buffer
that is *not* the last returned state (kept from an older call, or a slice of the current one) is
refused, since its bytes have been overwritten since it was returned.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from cadence_fx.binding import RegionSite
from cadence_fx.determinism import byte_view
from cadence_fx.runtime.errors import StaleState, StateMismatch, stale_message
from cadence_fx.runtime.owners import resolve_source
from cadence_fx.runtime.transaction import commit_copies

__all__ = ["StaleState", "StateCounts", "StateMismatch", "StateStore", "copy_into", "copy_state", "copy_states",
           "host_copy", "stale_message", "state_target", "state_to", "zero_bits"]

# A copy between devices into or out of a non-contiguous view stages the whole view through a
# contiguous temporary on the device; slices of at most this many bytes keep that temporary small.
_COPY_SLICE_BYTES = 32 << 20


@dataclass
class StateCounts:
    """How each call's region inputs reached the buffers."""

    adopted: int = 0   # copied in (foreign tensors: a prompt's state, a restored snapshot)
    in_place: int = 0  # the state the previous call returned, fed back as it is


class StateStore:
    """Region buffers by name, the program's workspaces, and the state each region last returned."""

    def __init__(self, region_buffers: Mapping[str, torch.Tensor]) -> None:
        self._buffers = dict(region_buffers)
        self._workspaces: list[torch.Tensor] = []
        self._returned: dict[str, torch.Tensor] = {}
        self.counts = StateCounts()

    # ------------------------------------------------------------------ what the store owns
    @property
    def region_buffers(self) -> Mapping[str, torch.Tensor]:
        """Each region's flat buffer (read-only mapping; the tensors are the program's own)."""
        return dict(self._buffers)

    def region_buffer(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def workspaces(self) -> list[torch.Tensor]:
        """The demand-sized workspace copies the program's graphs address."""
        return list(self._workspaces)

    def set_workspaces(self, tensors: list[torch.Tensor]) -> None:
        self._workspaces = list(tensors)

    def tensors(self) -> list[torch.Tensor]:
        """Everything that is state: region buffers, then workspaces."""
        return list(self._buffers.values()) + self._workspaces

    def owned_storages(self) -> frozenset[int]:
        """Storage data pointers of every region buffer and workspace."""
        return frozenset(t.untyped_storage().data_ptr() for t in self.tensors())

    def nbytes(self) -> dict[str, int]:
        return {"regions": _storage_bytes(self._buffers.values()), "workspaces": _storage_bytes(self._workspaces)}

    # ------------------------------------------------------------------ calls
    def adopt(self, name: str, arg: Any, site: RegionSite) -> torch.Tensor:
        """The tensor the graph reads region ``name`` from: ``arg`` itself when it is the state the
        last call returned, else a view of the buffer that ``arg`` was copied into."""
        buf = self._buffers[name]
        if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            if arg is self._returned.get(name):
                self.counts.in_place += 1
                return arg
            raise StaleState(stale_message(name, site.region.input))
        # another owner's buffer (a session's, another lane's, another program's): its current state is
        # copied in, an older view of it refused
        src = resolve_source(name, arg, site.region.input)
        self.counts.adopted += 1
        return copy_into(buf, name, src, site)

    def stage_crossed(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``args`` (region name -> the tensor fed as its state) with every tensor that lives in *another*
        region's buffer of this store cloned first: adopting one region copies into its buffer, which
        another region's input may be a view of (a state fed to the wrong region, two outputs swapped)."""
        ptrs = {b.untyped_storage().data_ptr(): n for n, b in self._buffers.items()}
        out = dict(args)
        for name, arg in args.items():
            if isinstance(arg, torch.Tensor) and ptrs.get(arg.untyped_storage().data_ptr(), name) != name:
                out[name] = arg.clone()
        return out

    def trusted_view(self, name: str, site: RegionSite) -> torch.Tensor:
        """A view of the buffer as the state input of ``site``, accepted in place (warm-up's inputs)."""
        view = site.state_view(self._buffers[name], site.live_shape)
        self._returned[name] = view
        return view

    def returned(self, name: str, tensor: Any) -> None:
        """Record the state output of region ``name``: the only view of its buffer the next call accepts."""
        if isinstance(tensor, torch.Tensor):
            self._returned[name] = tensor

    def last_returned(self) -> dict[str, torch.Tensor]:
        """The state each region's last call returned (the views the next call accepts in place)."""
        return dict(self._returned)

    def forget_returned(self) -> None:
        self._returned.clear()

    def set_returned(self, returned: Mapping[str, torch.Tensor]) -> None:
        """Put back the record of what the last call returned (a call that raised undoes its own)."""
        self._returned = dict(returned)

    # ------------------------------------------------------------------ warm-up
    @contextmanager
    def preserved(self, extra: Sequence[torch.Tensor] = ()) -> Iterator[frozenset[int]]:
        """Run a block (warm-up) and put back every byte of state, of ``extra`` (module buffers the
        programs write in place), the RNGs and the counts.

        Copies go to the host: warm-up must not raise the device peak by the size of the state. A
        tensor whose bytes are all zero (a lane as built, before any call) is not copied: it is zeroed
        again afterwards, which puts back the same bytes without the round trip through pageable host
        memory that took most of a lane's warm-up outside its captures.
        Yields the storages restored here, which captures inside the block need not snapshot.
        """
        state = self.tensors() + list(extra)
        saved = [None if zero else host_copy(t) for t, zero in zip(state, zero_bits(state))]
        rng = (torch.get_rng_state(), random.getstate(),
               torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        counts = StateCounts(self.counts.adopted, self.counts.in_place)
        returned = dict(self._returned)
        try:
            yield self.owned_storages() | frozenset(t.untyped_storage().data_ptr() for t in extra)
        finally:
            with torch.no_grad():
                for t, v in zip(state, saved):
                    if v is None:
                        t.zero_()
                    else:
                        t.copy_(v)
            torch.set_rng_state(rng[0])
            random.setstate(rng[1])
            if rng[2] is not None:
                torch.cuda.set_rng_state_all(rng[2])
            self.counts = counts
            self._returned = returned


def zero_bits(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether every byte of it is zero (bits, not values: -0.0 is not zero here), read on
    its device with one synchronization for all of them."""
    if not tensors:
        return []
    flags = [byte_view(t).any() for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    out = [False] * len(tensors)
    for idx in by_device.values():
        for i, nonzero in zip(idx, torch.stack([flags[i] for i in idx]).tolist()):
            out[i] = not nonzero
    return out


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the host (what :meth:`StateStore.preserved` puts back)."""
    return t.to("cpu", copy=True)


def copy_into(buf: torch.Tensor, name: str, arg: torch.Tensor, site: RegionSite, *,
              layout: bool = True) -> torch.Tensor:
    """Copy a state input into a region's flat buffer; returns the view the graph reads.

    ``layout=False`` for a session's own buffers: the contiguous prefix, whatever the region's layout
    in the lanes' buffers (:meth:`RegionSite.state_view`)."""
    view, src = state_target(buf, name, arg, site, layout=layout)
    # state is data, never part of an autograd graph: a state produced by ep.module() in grad
    # mode must not make the buffer require grad (every later view would then refuse in-place use)
    with torch.no_grad():
        copy_state(view, src)
    return view


def state_target(buf: torch.Tensor, name: str, arg: torch.Tensor, site: RegionSite, *,
                 layout: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the view of buf that arg's bytes go to, arg restricted to its live slots)``, checked.

    The unmodified program refuses a state of another dtype or shape; a copy would round or
    broadcast it silently, so neither is copied. A session call takes two such views per region
    (in and out), so the geometry of each checked pair is kept on the site and the next call of the
    same geometry takes its view in one step: the check's result depends only on the key."""
    shape = tuple(arg.shape)
    key = (buf.dtype, buf.storage_offset(), tuple(buf.shape), buf.stride(), arg.dtype, shape, layout)
    geo = site.geometry.get(key)
    if geo is None:
        view, src = _checked_target(buf, name, arg, site, layout=layout)
        site.geometry[key] = (tuple(view.shape), view.stride(), view.storage_offset(), tuple(src.shape))
        return view, src
    size, stride, offset, live = geo
    if live != shape:
        arg = arg[tuple(slice(0, n) for n in live)]
    return buf.as_strided(size, stride, offset), arg.detach()


def _checked_target(buf: torch.Tensor, name: str, arg: torch.Tensor, site: RegionSite, *,
                    layout: bool) -> tuple[torch.Tensor, torch.Tensor]:
    want = site.live_shape
    if arg.dtype != buf.dtype or arg.dim() != len(want):
        raise StateMismatch(f"region {name!r}: a state of dtype {arg.dtype} and rank {arg.dim()} given for input "
                            f"{site.region.input!r}, which holds {buf.dtype} of rank {len(want)} (shape {want} in "
                            f"this class)")
    for d, n in site.live:  # a stock-shaped state (a snapshot): only its live slots are state
        if arg.shape[d] > n:
            arg = arg.narrow(d, 0, n)
    if any(a != b for d, (a, b) in enumerate(zip(arg.shape, want)) if d != site.axis):
        raise StateMismatch(f"region {name!r}: a state of shape {tuple(arg.shape)} given for input "
                            f"{site.region.input!r}, whose shape is {want} outside axis {site.axis}")
    try:
        view = site.state_view(buf, arg.shape, layout=layout)
    except ValueError as e:
        raise StateMismatch(str(e)) from None
    return view, arg.detach()


def copy_state(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same shape). Between devices, where either side is not contiguous (a state in
    the envelope layout), in slices of the leading dims: PyTorch stages such a copy through a
    contiguous temporary of the whole tensor on the device, as large as the state itself."""
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()) or dst.dim() == 0 \
            or dst.numel() * dst.element_size() <= _COPY_SLICE_BYTES or tuple(dst.shape) != tuple(src.shape):
        dst.copy_(src)
        return
    for i in range(dst.shape[0]):
        copy_state(dst[i], src[i])


def copy_states(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """:func:`copy_state` for every pair; the pairs on one device as one ``_foreach_copy_``. A session
    call copies every region in: a Python loop of one copy per region gave the interpreter lock away
    at every copy, and with many sessions' threads each copy waited for the others' Python (the
    region count, 99 for Moshi's LM, times that wait)."""
    same = [(d, s) for d, s in zip(dsts, srcs) if d.device == s.device]
    commit_copies([d for d, _ in same], [s for _, s in same])
    for d, s in zip(dsts, srcs):
        if d.device != s.device:
            copy_state(d, s)


def state_to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of state tensor ``t`` on ``device`` (a snapshot to the host), contiguous, without the
    full-size temporary a plain ``t.to(device)`` makes on the GPU when ``t`` is a strided view."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    with torch.no_grad():
        copy_state(out, t)
    return out


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    return sum(seen.values())
