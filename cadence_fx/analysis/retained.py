"""Which positions of which tensor a region's outgoing state keeps, read off the graph.

The stock trim is ``cat([x[:P], x[-R:]])`` or ``x[-W:]`` of the concatenation of the old state and the new
positions: :func:`retained_parts` decomposes the outgoing value into such slices (:class:`Part`) and
checks them against the declared policy; a value that is computed rather than cut
(:class:`NotSlices`) or replaced whole is one :func:`whole_part`, copied once.
``retention_in_place`` writes the parts into the region's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from cadence_fx.analysis.graph_io import cat_dim, shape_of
from cadence_fx.analysis.ops import overload_name
from cadence_fx.binding import RegionSite
from cadence_fx.contract import ContractError, HeadTail, Ring


@dataclass
class Part:
    """A slice of ``base`` along the clock axis that lands at ``dst_offset`` of the outgoing state."""

    src: Node
    dst_offset: int
    length: int
    src_offset: int | None  # offset of src along the axis inside its base, when src is a slice of it
    base: Node


class NotSlices(Exception):
    """The outgoing state is computed, not cut from one tensor: the positions it keeps are not in the graph."""


def whole_part(value: object, site: RegionSite, growth: int) -> Part:
    """The whole outgoing state as one part (copied into the buffer once), after checking its extent
    against the policy: the only thing of the retention a computed or replaced state shows."""
    r = site.region
    if not isinstance(value, Node) or shape_of(value) is None:
        raise ContractError(f"Region {r.name!r}: output {r.output} is not a tensor computed by the graph")
    m = site.extent + growth
    expect = r.retention.capacity if isinstance(r.retention, Ring) else r.retention.apply(m)
    if site.out_extent != expect:
        raise ContractError(
            f"Region {r.name!r}: the program returns {site.out_extent} positions on axis {site.axis} for an "
            f"input of {site.extent} (+{growth} per call = {m}), but {r.retention!r} keeps {expect}; the graph's "
            "retention does not match the declaration")
    return Part(value, 0, expect, 0, value)


def retained_parts(value: object, site: RegionSite, growth: int) -> list[Part]:
    """Decompose the outgoing state into slices of one source, checking them against the policy."""
    r = site.region
    pol = r.retention
    name = r.name
    if not isinstance(value, Node) or shape_of(value) is None:
        raise ContractError(f"Region {name!r}: output {r.output} is not a tensor computed by the graph")
    m = site.extent + growth
    expect = pol.capacity if isinstance(pol, Ring) else pol.apply(m)
    if site.out_extent != expect:
        raise ContractError(
            f"Region {name!r}: the program returns {site.out_extent} positions on axis {site.axis} for an "
            f"input of {site.extent} (+{growth} per call = {m}), but {pol!r} keeps {expect}; the graph's "
            "retention does not match the declaration")
    trims = not isinstance(pol, Ring) and m > pol.bound()
    if trims and _as_slices(value, site.axis) is None:
        raise NotSlices(f"output {r.output} ({overload_name(value) or value.op} {value.name}) is not slices of one "
                        f"tensor along axis {site.axis}, so which positions it keeps cannot be read off the graph")
    if not trims:
        # the whole value; when it is a slice of a larger tensor (``kv[-W:]`` while kv is still shorter
        # than W), name that tensor and offset, so a slice of the in-place carry is seen to be in place
        whole = _as_slices(value, site.axis)
        if whole is not None and len(whole) == 1 and whole[0][3] - whole[0][2] == expect:
            node, base, start, _end = whole[0]
            return [Part(node, 0, expect, start, base)]
        return [Part(value, 0, expect, 0, value)]
    slices = _as_slices(value, site.axis)
    want = ([(0, pol.head), (m - pol.tail, m)] if isinstance(pol, HeadTail) else [(m - pol.size, m)])
    want = [w for w in want if w[1] > w[0]]
    if slices is not None:
        slices = [sl for sl in slices if sl[3] > sl[2]]  # an empty head or tail keeps nothing
    got = None if slices is None else [(s, e) for _node, _base, s, e in slices]
    bases = {b for _n, b, _s, _e in slices} if slices else set()
    base_ok = len(bases) == 1 and (shape_of(next(iter(bases))) or [0] * (site.axis + 1))[site.axis] == m
    if not base_ok:  # cut from something other than the concatenation of old and new (a tail of the new input)
        raise NotSlices(f"output {r.output} is cut from a tensor other than the {m}-position concatenation of the "
                        f"old state and the new positions")
    if got != want:
        found = f"slices {got} of a {m}-position tensor" if got else f"{overload_name(value) or value.op} {value.name}"
        raise ContractError(
            f"Region {name!r}: retention in the graph does not match {pol!r}: expected to keep "
            f"{want} of {m} positions on axis {site.axis}, found {found}")
    parts, offset = [], 0
    for node, base, s, e in slices:
        parts.append(Part(node, offset, e - s, s, base))
        offset += e - s
    return parts


def _as_slices(value: Node, axis: int) -> list[tuple[Node, Node, int, int]] | None:
    """``value`` as [(slice node, base, start, end)] along ``axis``: a cat of slices or a single slice."""
    items = value.args[0] if overload_name(value) == "cat" and cat_dim(value) == axis else [value]
    out = []
    for it in items:
        name = overload_name(it) if isinstance(it, Node) else ""
        if name not in ("slice", "narrow"):
            return None
        base = it.args[0]
        rank = len(shape_of(base) or ())
        dim = (it.args[1] if len(it.args) > 1 else 0) % max(rank, 1)
        n = (shape_of(base) or [0] * rank)[dim] if rank else 0
        if name == "narrow":
            start, length = it.args[2], it.args[3]
            if not isinstance(start, int) or not isinstance(length, int):
                return None
            start = _norm(start, n)
            end, step = start + length, 1
        else:
            start = it.args[2] if len(it.args) > 2 else 0
            end = it.args[3] if len(it.args) > 3 else n
            step = it.args[4] if len(it.args) > 4 else 1
            if not isinstance(start, (int, type(None))) or not isinstance(end, (int, type(None))):
                return None
            start, end = _norm(start, n), _norm(end if end is not None else n, n)
        if dim != axis or step != 1:
            return None
        out.append((it, base, start, end))
    return out


def _norm(i: int | None, n: int) -> int:
    if i is None:
        return 0
    if i < 0:
        i += n
    return max(0, min(i, n))
