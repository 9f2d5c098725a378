"""Running one partition with its branch plan, each cross-stream dependency an event, so a capture
records a graph whose independent chains are parallel branches (the plan is
:mod:`cadence_fx.analysis.branch_plan`'s, which says why it is exact).

Memory: a tensor read on another stream than the one it was allocated on is kept alive by the run
until the next fence (or the final join) has been launched. Every kernel launched after a fence is
ordered after it, and the fence after every read before it, so when the allocator hands that memory
to a later kernel, the read is done. ``record_stream`` would say the same, but inside a capture the
allocator defers every such block's reuse to the end of the capture, which grows the graph's pool.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import tree_leaves

from cadence_fx.analysis.branch_plan import BranchPlan

__all__ = ["BranchedRun"]


class BranchedRun:
    """Calls ``gm`` with the plan's streams (eagerly in warm-up, recorded inside a capture): same
    signature and results as ``gm(*args)``. ``streams[0]`` must be the current stream when called; the
    others are the backend's own, one per branch, kept for the process (cuBLAS keeps a workspace per
    stream it ran on, made in warm-up, before any capture)."""

    def __init__(self, gm: GraphModule, plan: BranchPlan, streams: Sequence[Any]) -> None:
        self.gm = gm
        self.plan = plan
        self.streams = list(streams)

    def __call__(self, *args: Any) -> Any:
        return _Interpreter(self.gm, self.plan, self.streams).run(*args)


class _Interpreter(Interpreter):
    def __init__(self, gm: GraphModule, plan: BranchPlan, streams: list[Any]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.plan = plan
        self.side = streams
        self.events: dict[Node, Any] = {}
        self.made_on: dict[int, int] = {}  # storage this run allocated -> the stream index it was allocated on
        self.held: list[torch.Tensor] = []  # read on another stream than their allocation's: freed after the next barrier

    def run(self, *args: Any, **kwargs: Any) -> Any:
        main = torch.cuda.current_stream()
        if main != self.side[0]:
            raise RuntimeError("a branched run starts on the stream its plan's stream 0 is")
        fork = torch.cuda.Event()
        fork.record(main)
        for k in self.plan.used:
            if k:  # inside a capture a side stream joins it here; one with no work must not (it would never rejoin)
                self.side[k].wait_event(fork)
        return super().run(*args, **kwargs)

    def run_node(self, n: Node) -> Any:
        if n.op in ("placeholder", "get_attr") or n not in self.plan.stream_of and n.op != "output":
            return super().run_node(n)  # views and sources: no kernel, whichever stream is current
        k = self.plan.stream_of.get(n, 0)
        stream = self.side[k]
        for p in self.plan.waits.get(n, ()):
            stream.wait_event(self.events[p])
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        read = set()
        for t in _tensors((args, kwargs)):
            ptr = t.untyped_storage().data_ptr()
            read.add(ptr)
            made = self.made_on.get(ptr)
            if made is not None and made != k:
                self.held.append(t)  # its memory is not reused before this stream's read of it is done
        with torch.cuda.stream(stream):
            out = getattr(self, n.op)(n.target, args, kwargs)
        for t in _tensors(out):
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr not in read:  # allocated by this node, on this stream (views of operands are not)
                self.made_on[ptr] = k
        if n in self.plan.recorded:
            ev = torch.cuda.Event()
            ev.record(stream)
            self.events[n] = ev
        if n in self.plan.barriers:
            self.held.clear()  # launched after every stream's reads so far: later kernels are ordered after them
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]
