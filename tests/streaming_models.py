"""Generated streaming step modules and their true native-clock contracts (for the contract property).

A :class:`ModelSpec` describes one small streaming step: one or two state regions, each a cache with
its clock axis at a chosen position of a chosen layout, concatenated old-then-new or new-then-old,
cut by a retention the model implements itself, and read whole by some computation so a wrong state
changes the outputs. :class:`StreamStep` builds the module, :func:`true_contract` its contract,
:func:`export_catalog` one static-shape program per catalog class of that contract.

Everything is tiny (a few dozen floats per tensor) so export and optimize take a fraction of a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import cadence_fx as cf

# name -> (sizes of the non-clock dims as symbols, position of the clock axis)
LAYOUTS: dict[str, tuple[tuple[str, ...], int]] = {
    "TC": (("C",), 0),  # leading: (T, C)
    "BTC": (("B", "C"), 1),  # (B, T, C)
    "BHTD": (("B", "H", "C"), 2),  # (B, H, T, D)
    "BCT": (("B", "C"), 2),  # clock axis last: (B, C, T), a conv context
    "CT": (("C",), 1),  # clock axis last, rank 2: (C, T)
}


@dataclass(frozen=True)
class RegionSpec:
    """One state region of a generated model.

    kind: ``"kv"`` (a growing cache, HeadTail or SlidingWindow) or ``"carry"`` (a fixed left context
    of ``k`` positions: ``cat([ctx, new])`` then ``k`` positions kept, declared Ring(k) or SlidingWindow(k)).
    policy: ``("headtail", head, tail)``, ``("window", size)`` or ``("ring", capacity)``.
    keep: which ``k`` positions a Ring carry keeps of the concatenation (``"last"`` or ``"first"``).
    grow: new positions per input frame (the region's growth is ``grow * chunk``).
    trim: how the model writes its retention (``"narrow"``, ``"slice"``: positive python slices,
    ``"neg"``: negative python slices).
    readout: how the model reads the whole concatenated cache (``"attn"``, ``"sum"``, ``"conv"``).
    reads: what the readout reads: ``"full"`` (the concatenation) or ``"kept"`` (the retained state).
    """

    kind: str
    layout: str
    dims: tuple[int, ...]  # sizes of the non-clock dims, in layout order
    order: str
    policy: tuple
    initial: int
    grow: int = 1
    keep: str = "last"
    trim: str = "narrow"
    readout: str = "attn"
    reads: str = "full"

    @property
    def axis(self) -> int:
        return LAYOUTS[self.layout][1]

    @property
    def rank(self) -> int:
        return len(self.dims) + 1

    def shape(self, extent: int) -> tuple[int, ...]:
        d = list(self.dims)
        return tuple(d[: self.axis] + [extent] + d[self.axis:])

    def retention(self):
        kind, *args = self.policy
        return {"headtail": cf.HeadTail, "window": cf.SlidingWindow, "ring": cf.Ring}[kind](*args)


@dataclass(frozen=True)
class ModelSpec:
    """One generated streaming step.

    Inputs (positional, exported as ``args_0``, ``args_1``, ...): ``x`` (chunk, dim) and one tensor per
    region, placed by ``in_perm`` (role -> position; role 0 is ``x``, role 1 + i is region i).
    Outputs: ``y`` (chunk, dim), one state per region and optionally ``aux`` (a read of region 0:
    ``"last"`` is a view of its last concatenated position, ``"state"`` a view of its outgoing state,
    ``"dup"`` the outgoing state itself a second time, ``"input"`` the incoming state returned as is,
    ``"mean"`` a reduction over the axis), placed by ``out_perm`` (role -> position; role 0 is ``y``,
    role 1 + i region i's state, the last role ``aux``).
    """

    dim: int
    chunk: int
    regions: tuple[RegionSpec, ...]
    aux: str = "none"
    in_perm: tuple[int, ...] = ()
    out_perm: tuple[int, ...] = ()
    wrap: tuple[str, ...] = ()
    growth_clock: bool = False  # a region with grow > 1 declares its own clock instead of Region.growth
    seed: int = 0

    @property
    def n_in(self) -> int:
        return 1 + len(self.regions)

    @property
    def n_out(self) -> int:
        return 1 + len(self.regions) + (self.aux != "none")

    def in_pos(self, role: int) -> int:
        return self.in_perm[role] if self.in_perm else role

    def out_pos(self, role: int) -> int:
        return self.out_perm[role] if self.out_perm else role


def _cat(order: str, cache: torch.Tensor, new: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.cat([cache, new], axis) if order == "old_new" else torch.cat([new, cache], axis)


def _take(x: torch.Tensor, axis: int, start: int, length: int, style: str) -> torch.Tensor:
    """Positions ``[start, start + length)`` of ``x`` along ``axis``, written the way a model would."""
    n = x.shape[axis]
    if style == "narrow":
        return x.narrow(axis, start, length)
    idx = [slice(None)] * axis
    if style == "neg" and length > 0 and start + length == n:
        idx.append(slice(-length, None))
    elif style == "neg" and start == 0:
        idx.append(slice(None, length - n if length < n else None))
    else:
        idx.append(slice(start, start + length))
    return x[tuple(idx)]


def retain(spec: RegionSpec, x: torch.Tensor) -> torch.Tensor:
    """The model's own retention of the concatenated cache ``x`` (what the stock driver does)."""
    axis, style = spec.axis, spec.trim
    m = x.shape[axis]
    kind, *args = spec.policy
    if kind == "headtail":
        head, tail = args
        if m <= head + tail:
            return x
        return torch.cat([_take(x, axis, 0, head, style), _take(x, axis, m - tail, tail, style)], axis)
    if kind == "window":
        (size,) = args
        return x if m <= size else _take(x, axis, m - size, size, style)
    (cap,) = args
    return _take(x, axis, m - cap, cap, style) if spec.keep == "last" else _take(x, axis, 0, cap, style)


class Block(nn.Module):
    """One region: project the new positions, concatenate, read the whole cache, retain."""

    def __init__(self, spec: RegionSpec, dim: int) -> None:
        super().__init__()
        self.spec = spec
        feat = math.prod(spec.dims)
        self.new = nn.Linear(dim, feat * spec.grow)
        self.q = nn.Linear(dim, feat)
        self.o = nn.Linear(feat, dim)
        if spec.readout == "conv":
            k = spec.retention().bound() if spec.kind == "carry" else 1
            self.conv = nn.Conv1d(feat, dim, k + 1)

    def forward(self, h: torch.Tensor, cache: torch.Tensor):
        s = self.spec
        n = h.shape[0]
        new = self.new(h).reshape(n * s.grow, *s.dims).movedim(0, s.axis)
        full = _cat(s.order, cache, new, s.axis)
        kept = retain(s, full)
        src = full if s.reads == "full" or s.readout == "conv" else kept
        m = src.shape[s.axis]
        flat = src.movedim(s.axis, 0).reshape(m, -1)  # (m, feat): every position it reads
        if s.readout == "attn":
            att = torch.softmax(self.q(h) @ flat.T / math.sqrt(flat.shape[1]), -1)
            h = h + self.o(att @ flat)
        elif s.readout == "sum":
            h = h + self.o(self.q(h) * flat.sum(0))
        else:  # a conv over the context + new positions (the conv carry's reason to exist)
            c = self.conv(flat.T.unsqueeze(0))  # (1, dim, m - k)
            h = h + c.mean(-1) + self.o(torch.tanh(self.q(h)) * flat.mean(0))
        return h, full, kept, cache


class StreamStep(nn.Module):
    """One streaming step generated from a :class:`ModelSpec`."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        torch.manual_seed(spec.seed)
        self.inp = nn.Linear(spec.dim, spec.dim)
        self.blocks = nn.ModuleList(Block(r, spec.dim) for r in spec.regions)
        self.out = nn.Linear(spec.dim, spec.dim)

    def forward(self, *args):
        s = self.spec
        h = self.inp(args[s.in_pos(0)])
        outs: list = [None] * s.n_out
        first_full = first_state = first_in = None
        for i, blk in enumerate(self.blocks):
            h, full, state, cache = blk(h, args[s.in_pos(1 + i)])
            outs[s.out_pos(1 + i)] = state
            if i == 0:
                first_full, first_state, first_in = full, state, cache
        outs[s.out_pos(0)] = self.out(h)
        if s.aux != "none":
            r0 = s.regions[0]
            if s.aux == "last":
                aux = first_full.narrow(r0.axis, first_full.shape[r0.axis] - 1, 1)
            elif s.aux == "state":
                aux = first_state.narrow(r0.axis, 0, 1)
            elif s.aux == "dup":
                aux = first_state
            elif s.aux == "input":
                aux = first_in
            else:
                aux = first_full.mean(r0.axis, keepdim=True)
            outs[s.out_pos(s.n_out - 1)] = aux
        return tuple(outs)


def true_contract(spec: ModelSpec) -> cf.Contract:
    """The native-clock contract the generated model actually follows."""
    clocks = [cf.Clock("frame", spec.chunk, "frames per call")]
    regions = []
    for i, r in enumerate(spec.regions):
        clock, growth = "frame", None
        if r.grow != 1:
            if spec.growth_clock:
                name = f"sub{i}"
                clocks.append(cf.Clock(name, r.grow * spec.chunk, "positions per call"))
                clock = name
            else:
                growth = r.grow * spec.chunk
        regions.append(cf.Region(f"r{i}", input=f"args_{spec.in_pos(1 + i)}", output=spec.out_pos(1 + i),
                                 clock=clock, axis=r.axis, order=r.order, retention=r.retention(),
                                 initial=r.initial, growth=growth))
    return cf.Contract(clocks=tuple(clocks), regions=tuple(regions), wrap=spec.wrap)


def example_args(spec: ModelSpec, extents: dict[str, int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    args: list = [None] * spec.n_in
    args[spec.in_pos(0)] = torch.randn(spec.chunk, spec.dim, generator=g)
    for i, r in enumerate(spec.regions):
        args[spec.in_pos(1 + i)] = torch.randn(*r.shape(extents[f"r{i}"]), generator=g)
    return tuple(args)


def export_catalog(model: StreamStep, contract: cf.Contract):
    """One static-shape program per distinct input signature of the contract's catalog classes."""
    eps, seen = [], set()
    for cls in cf.call_classes(contract):
        args = example_args(model.spec, cls)
        key = tuple(tuple(a.shape) for a in args)
        if key in seen:
            continue
        seen.add(key)
        eps.append(torch.export.export(model, args))
    return eps
