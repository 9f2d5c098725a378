"""Carry writeback: ``cat([cache, new])`` becomes an in-place write into the contract-owned buffer.

The region's history sits at the front of one flat buffer, so when the clock
axis is outermost (every dim before it has size 1) history + new positions is a
contiguous prefix of that buffer: writing only the new positions there and
reading the prefix gives the consumer the very tensor the concatenation would
have built (same values, same shape, same contiguous strides). The model's
concatenation order is checked against the declaration on every cat that
touches the region, including through views; a mismatch is an error.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from cadence_fx.annotations import CAT_NOT_APPEND, REGION_PREFIX
from cadence_fx.runtime.audit import audit, auditor_node
from cadence_fx.contract import ContractError, Ring
from cadence_fx.analysis.boxes import reach
from cadence_fx.analysis.graph_io import cat_dim, flat_outputs, flat_view, numel, register_tensor, shape_of
from cadence_fx.analysis.ops import aten, is_mutating, is_view, overload_name
from cadence_fx.analysis.traffic import UncountedBytes, state_bytes_written
from cadence_fx.passes import PassContext, RegionState, log

# Views that keep the clock axis where it is or move it predictably.
_AXIS_PRESERVING = {"alias", "detach", "contiguous", "clone"}


def carry_writeback(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Bind every region to its buffer; rewrite the region's append-concatenation into an in-place write."""
    if not ctx.config.state_rule:
        return gm
    graph = gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    record_state_bytes(gm, ctx, "stock")  # before any state pass: the unmodified program's traffic
    changed = 0
    for name, site in ctx.program.sites.items():
        region = site.region
        ph = placeholders[region.input]
        attr = register_tensor(gm, f"{REGION_PREFIX}{_ident(name)}_", ctx.program.region_buffers[name])
        state = RegionState(buffer_attr=attr, placeholder=ph)
        ctx.program.regions[name] = state
        if site.live:
            _bind_live(gm, site, ph)
        cats = _cats_on_axis(ph, site.axis)
        if not cats:
            if site.extent > 0 and region.order is not None:
                elsewhere = _cats_on_axis(ph, site.axis, any_axis=True)
                if elsewhere or _written_in_place(ph):  # the graph says otherwise: a wrong axis, or no cat at all
                    hint = "; a Ring the model writes in place declares order=None" if _is_ring(site) else ""
                    found = (f"it concatenates it along axis {cat_dim(elsewhere[0][0])} (node {elsewhere[0][0].name})"
                             if elsewhere else "it writes it in place")
                    raise ContractError(
                        f"Region {name!r}: the graph never concatenates input {region.input!r} along axis "
                        f"{site.axis}, but order={region.order!r} is declared ({found}); the cache pattern does not "
                        f"match the declaration{hint}")
                # read through something else first (a pad, a gather) and concatenated there: nothing to append
                ctx.program.leave_stock(CAT_NOT_APPEND, name, f"the graph concatenates input {region.input!r} only "
                                        f"after another op (no view of it is a cat operand)")
            continue
        if region.order is None:
            raise ContractError(
                f"Region {name!r}: declared order=None (a Ring written in place), but node {cats[0][0].name} "
                f"concatenates input {region.input!r} along axis {site.axis}; declare the order the model uses")
        middle = False
        for cat, pos, n_parts in cats:
            if 0 < pos < n_parts - 1:  # cat([key[:a], cache, key[a:]]): no order describes it, none is wrong
                ctx.program.leave_stock(CAT_NOT_APPEND, name, f"node {cat.name} concatenates input {region.input!r} "
                                        f"as operand {pos} of {n_parts} (neither first nor last)")
                middle = True
                continue
            found = "old_new" if pos == 0 else "new_old"
            if found != region.order:
                raise ContractError(
                    f"Region {name!r}: declared order {region.order!r} but node {cat.name} concatenates "
                    f"the cache as {found} ({overload_name(cat)} of {n_parts} operands); declare the "
                    "order the model uses")
        if middle:
            continue
        direct = [c for c, pos, _ in cats if c.args[0] and c.args[0][0] is ph and cat_dim(c) == site.axis]
        leading = all(s == 1 for s in site.shape[: site.axis])
        if not direct and len(cats) == 1 and cats[0][1] == 0 and _tail_of(cats[0][0].args[0][0], ph, site.axis):
            direct = [cats[0][0]]  # cat([ctx[..., s:], new]): the kept tail moves to the front, then the append
        if region.order == "old_new" and not leading and len(direct) == 1 and not site.live \
                and site.envelope is not None and _append_in_envelope(gm, ctx, name, site, state, direct[0]):
            changed += 1
            continue
        if region.order != "old_new" or not leading or len(direct) != 1 or site.live:
            continue  # the output-side writeback (retention_in_place) still owns the region
        cat = direct[0]
        cat_shape = shape_of(cat)
        capacity = ctx.program.region_buffers[name].numel()
        if cat_shape is None or numel(cat_shape) > capacity:
            continue
        inner = numel(site.shape[site.axis + 1:])
        with graph.inserting_before(cat):
            buf = graph.get_attr(attr)
            offset = site.extent
            for part in cat.args[0][1:]:
                pshape = shape_of(part)
                length = pshape[site.axis]
                dst = flat_view(graph, buf, offset * inner, pshape)
                graph.call_function(aten.copy_.default, (dst, part))
                offset += length
            carry = flat_view(graph, buf, 0, cat_shape)
        carry.meta["val"] = cat.meta.get("val")
        # the writes belong to the same wrapped call as the cat they replace (one partition, not three)
        node = buf
        while node is not cat:
            node.meta.setdefault("nn_module_stack", cat.meta.get("nn_module_stack", {}))
            node = node.next
        cat.replace_all_uses_with(carry)
        if ctx.config.verify:  # the original concatenation stays in the graph as the audit's reference
            with graph.inserting_before(cat.next):
                graph.call_function(audit, (auditor_node(gm, ctx.config.auditor), name, "carry append", carry, cat))
        state.carry = carry
        changed += 1
    graph.eliminate_dead_code()
    ctx.record("carry_writeback", changed)
    return gm


def _append_in_envelope(gm: GraphModule, ctx: PassContext, name: str, site, state: RegionState, cat: Node) -> bool:
    """``cat([ctx, new], axis)`` of a region in the envelope layout whose cat is the whole envelope (the
    class at the longest extent): the state at rest is the envelope's front, so writing ``new`` behind it
    leaves the very tensor the cat builds (same values, shape and contiguous strides) in the buffer.
    Returns whether it did (other classes keep their cat: the retention copies their state)."""
    env = site.envelope
    if shape_of(cat) != tuple(env):
        return False
    graph = gm.graph
    head = cat.args[0][0]
    start = 0 if head is state.placeholder else _tail_of(head, state.placeholder, site.axis)
    if start is None or len(head.users) != 1 or len(state.placeholder.users) != 1:
        return False  # the old state is read elsewhere too: moving its tail first would change what that reads
    with graph.inserting_before(cat):
        buf = graph.get_attr(state.buffer_attr)
        whole = flat_view(graph, buf, 0, env)
        offset = site.extent - start
        # the kept tail to the front, in copies of at most ``start`` positions, front first: each reads
        # positions no earlier copy wrote (the stock cat copies them once too)
        for k in range(0, offset if start else 0, start or 1):
            n = min(start, offset - k)
            to = graph.call_function(aten.narrow.default, (whole, site.axis, k, n))
            frm = graph.call_function(aten.narrow.default, (whole, site.axis, start + k, n))
            graph.call_function(aten.copy_.default, (to, frm))
        for part in cat.args[0][1:]:
            length = shape_of(part)[site.axis]
            dst = graph.call_function(aten.narrow.default, (whole, site.axis, offset, length))
            graph.call_function(aten.copy_.default, (dst, part))
            offset += length
    whole.meta["val"] = cat.meta.get("val")
    node = buf
    while node is not cat:  # the writes belong to the wrapped call the cat was part of
        node.meta.setdefault("nn_module_stack", cat.meta.get("nn_module_stack", {}))
        node = node.next
    cat.replace_all_uses_with(whole)
    if ctx.config.verify:
        with graph.inserting_before(cat.next):
            graph.call_function(audit, (auditor_node(gm, ctx.config.auditor), name, "carry append", whole, cat))
    state.carry = whole
    state.envelope = whole
    return True


def record_state_bytes(gm: GraphModule, ctx: PassContext, which: str) -> None:
    """Per region, the bytes one call writes to build its outgoing state (``ProgramFacts.state_bytes``);
    None where a value on the way cannot be sized (logged)."""
    outs = flat_outputs(gm.graph)
    aliases: dict = {}
    for state in ctx.program.regions.values():  # the region input is a view of its buffer at run time
        aliases[state.placeholder] = state.buffer_attr
        for n in gm.graph.find_nodes(op="get_attr", target=state.buffer_attr):
            aliases[n] = state.buffer_attr
    for name, site in ctx.program.sites.items():
        value = outs[site.region.output % len(outs)]
        try:
            count: int | None = state_bytes_written(gm.graph, value, aliases)
        except UncountedBytes as e:  # unknown, not 0: the count would leave out what it could not size
            log.warning("region %r: the state bytes of the %s program are not counted: %s", name, which, e)
            count = None
        ctx.program.state_bytes.setdefault(name, {})[which] = count


def _tail_of(node: object, ph: Node, axis: int) -> int | None:
    """Where ``node`` starts on ``axis`` when it is ``ph[..., s:]`` (a slice of ``ph`` to its end along the
    axis, step 1, ``s > 0``); else None."""
    if not isinstance(node, Node) or node.target is not aten.slice.Tensor or node.args[0] is not ph or node.kwargs:
        return None
    rank = len(shape_of(ph) or ())
    dim = (node.args[1] if len(node.args) > 1 else 0) % max(rank, 1)
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    n = (shape_of(ph) or (0,) * rank)[dim] if rank else 0
    if dim != axis or step != 1 or not isinstance(start, int) or not (end is None or (isinstance(end, int)
                                                                                       and end >= n)):
        return None
    start = start + n if start < 0 else start
    return start if 0 < start < n else None


def _written_in_place(ph: Node) -> bool:
    """Whether an in-place op writes ``ph`` or a view of it (a ring's ``index_copy_``, a slice assignment)."""
    stack, seen = [ph], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.args and u.args[0] is n and (is_mutating(u) or is_view(u)):
                if is_mutating(u):
                    return True
                stack.append(u)
    return False


def _cats_on_axis(ph: Node, axis: int, *, any_axis: bool = False) -> list[tuple[Node, int, int]]:
    """Every cat along the (tracked) clock axis that takes a view of ``ph``: (cat, operand index, operands);
    ``any_axis``: the cats along any axis."""
    found: list[tuple[Node, int, int]] = []
    frontier: list[tuple[Node, int]] = [(ph, axis)]
    seen: set[Node] = set()
    while frontier:
        node, ax = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            name = overload_name(user)
            if name == "cat":
                parts = user.args[0]
                if cat_dim(user) == ax or any_axis:
                    found.append((user, parts.index(node), len(parts)))
                continue
            new_ax = _track_axis(user, node, ax)
            if new_ax is not None:
                frontier.append((user, new_ax))
    return found


def _track_axis(user: Node, src: Node, ax: int) -> int | None:
    """Where the clock axis of ``src`` lands in ``user``, for the view ops we can follow; None otherwise."""
    name = overload_name(user)
    if user.op == "call_function" and getattr(user.target, "__name__", "") == "getitem":
        return ax if _is_split_like(src) else None
    if not (is_view(user) or name in _AXIS_PRESERVING) or user.args[0] is not src:
        return None
    rank = len(shape_of(src) or ())
    if name in _AXIS_PRESERVING or name in ("split", "split_with_sizes", "chunk", "unbind"):
        if name == "unbind":
            d = (user.args[1] if len(user.args) > 1 else 0) % rank
            return None if d == ax else ax - (d < ax)
        return ax
    if name == "slice":
        return ax  # a slice along the axis keeps it the clock axis (a prefix or window of history)
    if name == "select":
        d = user.args[1] % rank
        return None if d == ax else ax - (d < ax)
    if name == "unsqueeze":
        d = user.args[1] % (rank + 1)
        return ax + (d <= ax)
    if name == "transpose":
        a, b = user.args[1] % rank, user.args[2] % rank
        return b if ax == a else a if ax == b else ax
    if name == "permute":
        perm = [p % rank for p in user.args[1]]
        return perm.index(ax)
    return None


def _bind_live(gm: GraphModule, site, ph: Node) -> None:
    """The region arrives holding only its live slots: prove the graph reads no more than that.
    (torch.export's input guard, which knows only the stock shape, is gone already: ``drop_static_guards``.)"""
    name = site.region.name
    found = reach([ph], site.shape)
    if found is None:
        raise ContractError(f"Region {name!r}.live: cannot bound which positions the graph reads of input "
                            f"{site.region.input!r} (a use escapes slicing)")
    bounds, rewrites = found
    for d, n in site.live:
        if bounds[d] > n:
            raise ContractError(f"Region {name!r}.live: the graph reads {bounds[d]} of the {site.shape[d]} "
                                f"positions on dim {d} of input {site.region.input!r}, but only {n} are declared live")
    for node, args in rewrites:  # negative indices would count from the live end, not the stock end
        node.args = args


def _is_split_like(node: Node) -> bool:
    return overload_name(node) in ("split", "split_with_sizes", "chunk", "unbind")


def _is_ring(site) -> bool:
    return isinstance(site.region.retention, Ring)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


