"""Independent chains of one replayed partition: which kernel goes on which stream (the analysis;
:mod:`cadence_fx.runtime.branch_run` runs it).

A captured graph runs its kernels in the order of the stream they were captured on, one after the
other, even where the dataflow would let two run at once (the query, key and value projections of an
attention layer and their rotary embeddings; the parallel residual blocks of a vocoder stage). At the
sizes of a streaming step most kernels use a fraction of the GPU, so each waits for the previous one
to finish and pays the switch between them.

:func:`plan_branches` assigns every kernel of a partition to one of a few streams by list scheduling
over the dataflow; :class:`BranchedRun` runs the partition with that assignment, each cross-stream
dependency an event, so a capture records a graph whose independent chains are parallel branches.

Exactness: every node runs the same op on the same operands as the stock program; only which kernels
may overlap changes. Nothing that writes memory (an in-place op, an ``out=`` op, a call of a module or
of a Python function), and nothing that draws from a generator, is moved off the capture stream: each
such node is a fence, after everything launched before it and before everything launched after it,
on every stream. So every read and write of state keeps the stock order. Between fences, nodes are
pure ATen ops that only allocate their outputs (a seeded op whose arguments make it draw nothing, an
eval-mode dropout, is pure: :func:`~cadence_fx.analysis.ops.draws`).

Memory: a tensor read on another stream than the one it was allocated on is kept alive by the run
until the next fence (or the final join) has been launched. Every kernel launched after a fence is
ordered after it, and the fence after every read before it, so when the allocator hands that memory
to a later kernel, the read is done. ``record_stream`` would say the same, but inside a capture the
allocator defers every such block's reuse to the end of the capture, which grows the graph's pool.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.fx import GraphModule, Node

from cadence_fx.analysis.ops import draws, is_mutating, is_out_op, is_view

__all__ = ["BranchPlan", "plan_branches"]


@dataclass
class BranchPlan:
    """Where each node of a partition runs: stream index (0: the capture stream) and what it waits for."""

    streams: int                                   # streams the plan spans (1: nothing runs in parallel)
    used: tuple[int, ...] = (0,)                   # the streams with work: only these fork and join
    stream_of: dict[Node, int] = field(default_factory=dict)
    waits: dict[Node, tuple[Node, ...]] = field(default_factory=dict)   # kernels on other streams, in order
    recorded: set[Node] = field(default_factory=set)   # nodes some other stream waits for (an event each)
    fences: int = 0
    barriers: set[Node] = field(default_factory=set)   # the fences and the output: every stream is joined there
    kernels: int = 0
    moved: int = 0                                  # kernels placed off the capture stream


# ops that only make a view: no kernel, whatever the strides (``reshape``, ``contiguous``, ``flatten`` and
# ``to`` alias their input only when they can, else copy: they are scheduled as kernels)
_VIEWS = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "as_strided", "slice", "select", "narrow", "unsqueeze", "squeeze", "permute",
    "transpose", "t", "expand", "expand_as", "view_as", "alias", "diagonal", "unfold", "split", "split_with_sizes",
    "chunk", "unbind", "detach", "movedim", "unflatten", "swapaxes", "swapdims", "view_as_real", "view_as_complex"))


def _alias(n: Node) -> bool:
    """Runs no kernel: a view of its input, or one element of a multi-output op's result."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name in _VIEWS and is_view(n)


# ops that call cuBLAS (SDPA's math path does): every stream that runs one keeps a cuBLAS workspace of its
# own for the process (torch sizes it per (handle, stream); 32 MiB on Hopper)
_BLAS = frozenset(f"aten::{name}" for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "addmv", "mv", "dot",
    "vdot", "addr", "einsum", "tensordot", "_scaled_mm", "scaled_dot_product_attention"))


def _uses_blas(n: Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name in _BLAS


def _pure(n: Node) -> bool:
    """An ATen op that only reads its operands and allocates its result: free to run on any stream."""
    t = n.target
    return (n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and not is_mutating(n)
            and not is_out_op(n) and not draws(n))


def plan_branches(gm: GraphModule, max_streams: int, *, blas_streams: int | None = None) -> BranchPlan:
    """Assign the kernels of ``gm`` to at most ``max_streams`` streams (greedy list scheduling, one unit
    of time per kernel): each kernel goes to the stream where it can start earliest, ties broken toward
    the stream of its own operands (no wait) and then the capture stream.

    ``blas_streams``: the matrix products (cuBLAS calls) go only to the first that many streams, so the
    process keeps that many cuBLAS workspaces rather than one per stream (default: every stream)."""
    plan = BranchPlan(streams=1)
    if max_streams < 2:
        return plan
    blas = max_streams if blas_streams is None else max(1, min(blas_streams, max_streams))
    source: dict[Node, frozenset[Node]] = {}   # node -> the kernel nodes whose outputs it is (views follow)
    finish: dict[Node, int] = {}
    free = [0] * max_streams                      # when each stream's last kernel ends
    tail: list[Node | None] = [None] * max_streams
    fence: Node | None = None
    fence_time = 0
    waited: list[dict[int, int]] = [dict() for _ in range(max_streams)]  # stream -> {other: position waited}
    position: dict[Node, int] = {}                # a kernel's index on its stream
    count = [0] * max_streams
    used = {0}

    def producers(n: Node) -> frozenset[Node]:
        out: set[Node] = set()
        for a in n.all_input_nodes:
            out |= source.get(a, frozenset())
        return frozenset(out)

    def place(n: Node, s: int, deps: frozenset[Node], extra: Sequence[Node] = ()) -> None:
        need = []
        for p in sorted(set(deps) | set(extra), key=lambda p: (finish[p], position[p])):
            ps = plan.stream_of[p]
            if ps != s and waited[s].get(ps, -1) < position[p]:
                need.append(p)
                waited[s][ps] = position[p]
                plan.recorded.add(p)
        if need:
            plan.waits[n] = tuple(need)
        plan.stream_of[n] = s
        position[n] = count[s]
        count[s] += 1
        tail[s] = n
        used.add(s)

    out_node = None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            source[n] = frozenset()
            continue
        if n.op == "output":
            out_node = n
            break
        if _alias(n):
            source[n] = producers(n)
            continue
        deps = producers(n)
        if _pure(n):
            plan.kernels += 1
            ready = max([finish[p] for p in deps] + [fence_time])
            own = {plan.stream_of[p] for p in deps}
            s = min(range(blas if _uses_blas(n) else max_streams),
                    key=lambda k: (max(ready, free[k]), k not in own, k != 0, k))
            # after a fence, a side stream's first kernel waits for it (place skips what is already ordered)
            place(n, s, deps, [fence] if fence is not None else [])
            finish[n] = max(ready, free[s]) + 1
            free[s] = finish[n]
            plan.moved += s != 0
        else:
            # a fence: on the capture stream, after every other stream's last kernel
            plan.fences += 1
            plan.barriers.add(n)
            place(n, 0, deps, [t for k, t in enumerate(tail) if k != 0 and t is not None])
            fence_time = max(free) + 1
            finish[n] = fence_time
            free = [fence_time] * max_streams
            fence = n
        source[n] = frozenset({n})
    if out_node is not None:
        # every stream joins the capture stream: a capture must end on the stream it began on
        place(out_node, 0, frozenset(), [t for k, t in enumerate(tail) if k != 0 and t is not None])
        plan.barriers.add(out_node)
    plan.streams = max(used) + 1
    plan.used = tuple(sorted(used))
    return plan
