"""A fed-back state input's clock axis, growth, order and retention, each checked against the stream.

Shapes say which dim is the clock and how far the extent goes; only values say what is kept. Every
retention proposed here was checked position by position at every observed call: the output against
the concatenation the eager step made (:class:`~cadence_fx.proposal.observe.SeenCat`), or, where no
concatenation was seen, against the positions the old state contributes. A stream that fits nothing
is a :class:`~cadence_fx.ContractError` naming the input and what was seen, never a guess.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from cadence_fx.contract import ContractError, HeadTail, Order, Retention, Ring, SlidingWindow
from cadence_fx.proposal.graph_facts import CatFact, WriteFact
from cadence_fx.proposal.observe import SeenCat, changed_positions, same_value

Kept = Callable[[int], list[int]]  # positions of the concatenation (of length L) the state keeps


@dataclass(frozen=True)
class Derived:
    axis: int
    order: Order | None
    retention: Retention
    initial: int
    growth: int | None  # None: nothing is appended (a recurrent state follows the clock)
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class Seen:
    """One state input over the stream: its value at each call, the output, the cats of it, the graph."""

    name: str
    olds: Sequence[torch.Tensor]
    outs: Sequence[torch.Tensor]
    cats: Sequence[Sequence[SeenCat]]  # per call
    graph_cats: Sequence[CatFact]
    graph_writes: Sequence[WriteFact]


def derive_region(s: Seen) -> Derived:
    """Axis, growth, order and retention of one fed-back state input; raises ContractError if nothing fits."""
    ev: list[str] = []
    rank = s.olds[0].dim()
    if rank == 0:
        raise ContractError(f"input {s.name!r}: a 0-d state has no axis to declare; keep it as a tensor of shape (1,)")
    ext_in = [t.shape for t in s.olds]
    ext_out = [t.shape for t in s.outs]
    changing = [d for d in range(rank) if len({sh[d] for sh in ext_in + ext_out}) > 1]
    if len(changing) > 1:
        raise ContractError(f"input {s.name!r}: sizes change on dims {changing} across calls "
                            f"(shapes {[tuple(x) for x in ext_in]}); a region grows along one clock axis")
    axis = changing[0] if changing else _fixed_axis(s, rank, ev)
    if changing:
        ev.append(f"clock axis {axis}: the only dim whose size changes across calls")
    tin = [int(x[axis]) for x in ext_in]
    tout = [int(x[axis]) for x in ext_out]
    ev.append(f"extents along axis {axis} per call: input {tin}, output {tout}")
    gcat = next((c for c in s.graph_cats if c.dim == axis), None)
    # the eager cat that is the graph's (the same operand of as many): another one's values say nothing here
    cats = [next((c for c in per if c.dim == axis and (gcat is None or (c.position, c.operands) ==
                                                         (gcat.position, gcat.operands))), None) for per in s.cats]
    order = _order(s, gcat, axis, ev)
    growth = _growth(s, cats, gcat, tin, tout, ev)
    if not changing:
        return _fixed(s, axis, order, growth, cats, tin[0], ev)
    return _growing(s, axis, order, growth, cats, tin, tout, ev)


def _fixed_axis(s: Seen, rank: int, ev: list[str]) -> int:
    for c in s.graph_cats:
        if c.dim is not None:
            ev.append(f"clock axis {c.dim}: the size is fixed, and graph node {c.node!r} concatenates the state "
                      f"on dim {c.dim}")
            return c.dim
    for w in s.graph_writes:
        if w.dim is not None:
            ev.append(f"clock axis {w.dim}: the size is fixed, and graph node {w.node!r} (aten.{w.op}) writes "
                      f"positions of the state along dim {w.dim}")
            return w.dim
    ev.append(f"clock axis {rank - 1}: the size is fixed and the graph neither concatenates nor writes positions "
              "of the state; the last dim is taken (a conv-like context keeps its time last; a recurrent state "
              "may name any axis)")
    return rank - 1


def _order(s: Seen, gcat: CatFact | None, axis: int, ev: list[str]) -> Order | None:
    if gcat is None:
        return None
    where = f"graph node {gcat.node!r} (aten.cat) takes the state as operand {gcat.position} of {gcat.operands} " \
            f"along dim {axis}{gcat.through()}" + (" (the state's output is cut from it)" if gcat.feeds_output else "")
    if gcat.position == 0:
        ev.append(f"order 'old_new': {where}")
        return "old_new"
    if gcat.position == gcat.operands - 1:
        ev.append(f"order 'new_old': {where}")
        return "new_old"
    ev.append(f"order 'old_new' (chosen): {where}, a middle operand; cadence_fx copies such concatenations "
              "as they are")
    return "old_new"


def _growth(s: Seen, cats: Sequence[SeenCat | None], gcat: CatFact | None, tin: list[int], tout: list[int],
            ev: list[str]) -> int | None:
    added = [c.added for c in cats if c is not None]
    if added and len(added) == len(cats):
        if len(set(added)) > 1:
            raise ContractError(f"input {s.name!r}: the positions concatenated to it vary per call {added}; a "
                                "region grows by a fixed number of positions a call")
        ev.append(f"growth {added[0]} a call: at every call the eager torch.cat added {added[0]} positions "
                  "(its other operands, the new input) to the state")
        return added[0]
    if gcat is not None and gcat.added:
        ev.append(f"growth {gcat.added} a call, read off the graph: the other operands of graph node {gcat.node!r} "
                  f"have that extent (the cat's extent along the axis less the state's operand's)")
        return gcat.added
    write = next((w for w in s.graph_writes if w.count), None)
    if write is not None and write.count:
        ev.append(f"growth {write.count} a call: graph node {write.node!r} writes {write.count} positions")
        return write.count
    bound = max(tout)
    k = next((k for k, (a, b) in enumerate(zip(tin, tout)) if a < b < bound), None)
    if k is not None:
        ev.append(f"growth {tout[k] - tin[k]} a call, read off the extents (no cat of the state in the graph says "
                  f"it): call {k} takes {tin[k]} and returns {tout[k]}, below the bound {bound}, so nothing is "
                  "trimmed there")
        return tout[k] - tin[k]
    return None


def _growing(s: Seen, axis: int, order: Order | None, g: int | None, cats: Sequence[SeenCat | None],
             tin: list[int], tout: list[int], ev: list[str]) -> Derived:
    bound = max(tout)
    if tin[0] == 0 and all(t == bound for t in tout) and (g is None or g < bound):
        # empty at the first call, full from its output on: a context there is none of before the stream
        return _fixed(s, axis, order, g, cats, bound, ev, first=1)
    if g is None or g <= 0:
        raise ContractError(f"input {s.name!r}: its extent changes ({tin}) but no concatenation along axis {axis} "
                            "was seen in the graph or the eager run; cannot tell how it grows")
    errors: list[ContractError] = []
    orders: list[Order] = [order] if order is not None else ["old_new", "new_old"]
    for o in orders:
        try:
            pol, said = _fit_window(s, axis, o, g, cats, tin, tout)
        except ContractError as e:
            errors.append(e)
            continue
        if order is None:
            ev.append(f"order {o!r} (chosen): the graph never concatenates the state along dim {axis}, itself or "
                      "through a chain of ops (pads, copies, cuts); the values fit it (the old positions are where "
                      f"{'cat(old, new)' if o == 'old_new' else 'cat(new, old)'} puts them); cadence_fx copies such "
                      "a state (a finding): the declared order only has to be the one the values follow")
        ev.append(said)
        return Derived(axis, o, pol, tin[0], g, tuple(ev))
    raise errors[0]


def _fit_window(s: Seen, axis: int, order: Order, g: int, cats: Sequence[SeenCat | None], tin: list[int],
                tout: list[int]) -> tuple[Retention, str]:
    """The retention of a state growing by ``g`` a call up to a bound, checked by values under ``order``,
    and the sentence saying so; raises ContractError where no policy fits."""
    full = [t + g for t in tin]
    if tout == full:
        raise ContractError(f"input {s.name!r}: it grows by {g} at every observed call (extents {tin} -> {tout}) "
                            "and is never trimmed; an unbounded history has no retention (record a longer "
                            "stream, or trim it in the model)")
    bound = max(tout)
    if any(o != (f if f <= bound else bound) for o, f in zip(tout, full)):
        raise ContractError(f"input {s.name!r}: output extents {tout} do not follow one bound over the concatenated "
                            f"extents {full}")
    trimmed = [k for k, f in enumerate(full) if f > bound]
    # where nothing is trimmed every policy keeps the whole concatenation: checked once, not per candidate
    whole = _check(s, axis, order, g, cats, lambda n: list(range(n)), [k for k in range(len(full)) if k not in trimmed])
    if whole is not None:
        raise ContractError(f"input {s.name!r}: at call {whole} nothing is trimmed ({full[whole]} <= {bound}), but the "
                            "output is not the concatenation of the state and the new positions (checked by values); "
                            "no retention policy fits")
    heads = [tin[0]] if 0 < tin[0] < bound else []
    heads += [h for h in range(1, bound + 1) if h not in heads]  # tail 0: the first positions alone
    candidates: list[tuple[Retention, Kept, str]] = [
        (SlidingWindow(bound), lambda n: list(range(max(0, n - bound), n)), f"the last {bound} positions")]
    candidates += [(HeadTail(h, bound - h), _head_tail(h, bound - h),
                    f"the first {h}{' (the initial extent, a prompt)' if h == tin[0] else ''} and the last "
                    f"{bound - h} positions") for h in heads]
    misses: list[str] = []
    for pol, kept, what in candidates:
        checked = _check(s, axis, order, g, cats, kept, trimmed)
        if checked is not None and len(misses) < 2:
            misses.append(f"{pol!r} differs at call {checked}")
        if checked is None:
            return pol, (f"retention {pol!r}: the extent grows by {g} a call up to {bound}, then stays; "
                         f"{_how(cats)}, the output is {what} of the concatenation at every one of the "
                         f"{len(tin)} calls ({len(trimmed)} of them trimmed)")
    raise ContractError(f"input {s.name!r}: extents {tin} settle at {bound}, but the output is not "
                        f"the last {bound} positions of the concatenation nor its first h and last {bound}-h for any h "
                        f"at every call (checked by values: {', '.join(misses)}); no retention policy fits")


def _fixed(s: Seen, axis: int, order: Order | None, g: int | None, cats: Sequence[SeenCat | None], c: int,
           ev: list[str], first: int = 0) -> Derived:
    """A state of extent ``c`` at every call from call ``first`` on (1: empty at the first call, ``initial=0``)."""
    initial = 0 if first else c
    calls = range(first, len(s.olds))
    extent = f"the extent is {c} at every call" if not first else \
        f"the state is empty at the first call (initial=0) and {c} at every call after"
    if order is not None and g:
        for keep, kept in (("last", lambda n: list(range(n - c, n))), ("first", lambda n: list(range(c)))):
            if _check(s, axis, order, g, cats, kept, calls) is not None:
                continue
            how = _how(cats[first:])
            if keep == "last" and order == "old_new" and g >= c:
                ev.append(f"retention {SlidingWindow(c)!r}: {extent}; {how}, the next "
                          f"state is the last {c} positions of cat(old, new), which lie in the new input alone "
                          f"(the chunk, {g}, is at least the context, {c}: a causal conv's padding cache, "
                          "next = x[..., -k:]); declared as a window over the concatenation with its order")
                return Derived(axis, order, SlidingWindow(c), initial, g, tuple(ev))
            ev.append(f"retention {Ring(c)!r}: {extent}; {how}, the next state is the {keep} "
                      f"{c} positions of the concatenation (a fixed-size context rebuilt every call)")
            return Derived(axis, order, Ring(c), initial, g, tuple(ev))
        if not s.graph_writes:
            raise ContractError(f"input {s.name!r}: a fixed extent {c} on axis {axis}, concatenated with {g} new "
                                "positions a call, but the next state is neither the first nor the last "
                                f"{c} positions of the concatenation (checked by values)")
    positional = [w for w in s.graph_writes if w.dim == axis]
    if positional:
        return _written(s, axis, positional, c, g, ev, first)
    ev.append(f"retention Ring({c}), order None: {extent}; the graph neither concatenates the state nor writes "
              f"positions of it; a recurrent state (an RNN's hidden state, a running statistic, a context "
              f"computed whole every call), declared as a Ring over axis {axis}, capacity {c}, as the README "
              "prescribes")
    if all(same_value(o, n) for o, n in zip(s.olds, s.outs)):
        ev.append("the state was returned unchanged by every observed call (a pass-through)")
    return Derived(axis, None, Ring(c), initial, None, tuple(ev))


def _written(s: Seen, axis: int, writes: list[WriteFact], c: int, g: int | None, ev: list[str],
             first: int = 0) -> Derived:
    changed = {k: changed_positions(s.olds[k], s.outs[k], axis) for k in range(first, len(s.olds))}
    limit = sum(w.count or 0 for w in writes) or c
    bad = next((k for k, ch in changed.items() if len(ch) > limit), None)
    nodes = ", ".join(f"{w.node!r} (aten.{w.op}, {w.count} positions)" for w in writes)
    if bad is not None:
        raise ContractError(f"input {s.name!r}: graph node(s) {nodes} write {limit} positions along axis {axis} a "
                            f"call, but {len(changed[bad])} changed at call {bad}; not a ring written in place")
    shown = "; ".join(f"call {k}: {ch}" for k, ch in list(changed.items())[:4])
    ev.append(f"retention Ring({c}), order None: written in place by graph node(s) {nodes} along dim {axis}; "
              f"checked by values at every call: at most {limit} positions changed and every other one is "
              f"torch.equal to the old state (changed positions: {shown}{'; ...' if len(changed) > 4 else ''})")
    counts = Counter(len(ch) for ch in changed.values())
    if g is None and counts:
        g = counts.most_common(1)[0][0] or None
    return Derived(axis, None, Ring(c), 0 if first else c, g, tuple(ev))


def _head_tail(head: int, tail: int) -> Kept:
    return lambda n: list(range(n)) if n <= head + tail else list(range(head)) + list(range(n - tail, n))


def _how(cats: Sequence[SeenCat | None]) -> str:
    if all(c is not None for c in cats):
        return "checked by values against the concatenation the eager step made"
    return "checked by values on the positions the old state contributes (no eager torch.cat of it was seen)"


def _check(s: Seen, axis: int, order: Order, g: int, cats: Sequence[SeenCat | None], kept: Kept,
           calls: Sequence[int] | None = None) -> int | None:
    """The first of ``calls`` (default: all) at which the output is not the ``kept`` positions of the
    concatenation (None: none)."""
    for k in range(len(s.olds)) if calls is None else calls:
        old, out = s.olds[k], s.outs[k]
        n = old.shape[axis] + g
        idx = kept(n)
        if out.shape[axis] != len(idx):
            return k
        cat = cats[k]
        if cat is not None and cat.value.shape[axis] == n:
            if not same_value(out, cat.value.index_select(axis, torch.tensor(idx, device=out.device))):
                return k
            continue
        first_old = 0 if order == "old_new" else g  # the concatenation's index of the state's position 0
        pairs = [(p, i - first_old) for p, i in enumerate(idx) if 0 <= i - first_old < old.shape[axis]]
        if pairs:
            mine = torch.tensor([p for p, _ in pairs], device=out.device)
            theirs = torch.tensor([i for _, i in pairs], device=out.device)
            if not same_value(out.index_select(axis, mine), old.index_select(axis, theirs)):
                return k
    return None
