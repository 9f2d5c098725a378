"""Resolving a contract against an exported program: which node is which region.

Every check that needs the program (a region input that is not a placeholder,
an axis out of range, a wrapped path that matches no node) lives here, so the
plan and the passes see the same, already validated, view of the program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from cadence_fx.contract import Contract, ContractError, Region


@dataclass(frozen=True)
class RegionSite:
    """Where one region enters and leaves one exported program."""

    region: Region
    axis: int  # normalised to a non-negative index
    shape: tuple[int, ...]  # shape of the region input in this program
    out_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    live: tuple[tuple[int, int], ...] = ()  # (dim, live size) for dims with dead stock capacity
    # the envelope layout (``RegionPlan.layout``): the buffer is this shape (the live shape with the
    # clock axis at its longest in-flight extent) and a state of extent T is ``narrow(axis, 0, T)``;
    # None: the state is the contiguous prefix of the flat buffer
    envelope: tuple[int, ...] | None = None
    # the views a session call takes of a region buffer, by (buffer, state) geometry, once checked:
    # (size, stride, storage offset of the view, live shape of the state); see runtime.state.state_target
    geometry: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def live_shape(self) -> tuple[int, ...]:
        """The input shape restricted to the live extent: what the region buffer holds."""
        return _restrict(self.shape, self.live)

    @property
    def live_out_shape(self) -> tuple[int, ...]:
        return _restrict(self.out_shape, self.live)

    def state_view(self, buf: torch.Tensor, shape: Sequence[int], *, layout: bool = True) -> torch.Tensor:
        """The view of flat buffer ``buf`` that holds a state of ``shape`` (live dims only).

        ``layout=False``: the contiguous prefix whatever the region's layout (a session's own
        buffers, which only store the state between calls and are never addressed by a graph)."""
        shape = tuple(shape)
        n = math.prod(shape)
        env = self.envelope if layout else None
        if env is None:
            if n > buf.numel():
                raise ValueError(f"region {self.region.name!r}: a state of shape {shape} exceeds the contract-owned "
                                 f"buffer ({buf.numel()} elements)")
            return buf[:n].view(shape)
        if len(shape) != len(env) or any(a != b for i, (a, b) in enumerate(zip(shape, env)) if i != self.axis) \
                or shape[self.axis] > env[self.axis]:
            raise ValueError(f"region {self.region.name!r}: a state of shape {shape} does not fit the region's "
                             f"envelope {env} (equal outside axis {self.axis}, at most {env[self.axis]} on it)")
        return buf[: math.prod(env)].view(env).narrow(self.axis, 0, shape[self.axis])

    @property
    def output(self) -> int:
        """The index of the program output that carries the region out (a module-buffer region has one
        too by the time it is bound: :mod:`cadence_fx.buffer_regions` lifts it into an output first)."""
        out = self.region.output
        if out is None:
            raise ContractError(f"Region {self.region.name!r}: a module-buffer region bound before it was lifted")
        return out

    @property
    def extent(self) -> int:
        return self.shape[self.axis]

    @property
    def out_extent(self) -> int:
        return self.out_shape[self.axis]


def _restrict(shape: tuple[int, ...], live: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    out = list(shape)
    for d, n in live:
        out[d] = n
    return tuple(out)


def input_names(ep: ExportedProgram) -> list[str]:
    """The exported program's user inputs, in calling order, by name (a Python scalar export baked in,
    ``ConstantArgument``, is named too: ``graph_signature.user_inputs`` holds its value instead)."""
    return [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]


def _static_shape(val: object, what: str) -> tuple[int, ...]:
    if not isinstance(val, torch.Tensor):
        raise ContractError(f"{what}: is not a tensor in the exported program")
    try:
        return tuple(int(s) for s in val.shape)
    except TypeError as e:  # symbolic sizes
        raise ContractError(f"{what}: has symbolic shape {tuple(val.shape)}; export one program per "
                            "catalog class with static shapes (see cadence_fx.plan)") from e


def bind_regions(ep: ExportedProgram, contract: Contract) -> dict[str, RegionSite]:
    """Validate ``contract`` against ``ep`` and locate every region; raises ContractError naming the field."""
    contract.validate_self()
    names = input_names(ep)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user_outs = list(ep.graph_signature.user_outputs)
    out_node = ep.graph.output_node()
    out_by_name = {a.name: a for a in out_node.args[0] if isinstance(a, Node)}
    sites: dict[str, RegionSite] = {}
    for r in contract.regions:
        where = f"Region {r.name!r}"
        if r.input not in names:
            kind = "is not a user input placeholder" if r.input in placeholders else "names no program input"
            raise ContractError(f"{where}.input: {r.input!r} {kind}; user inputs are {names}")
        val = placeholders[r.input].meta.get("val")
        shape = _static_shape(val, f"{where}.input {r.input!r}")
        if not -len(shape) <= r.axis < len(shape):
            raise ContractError(f"{where}.axis: {r.axis} is out of range for input {r.input!r} of rank {len(shape)}")
        axis = r.axis % len(shape)
        if not 0 <= r.output < len(user_outs) and not (-len(user_outs) <= r.output < 0):
            raise ContractError(f"{where}.output: index {r.output} out of range; the program has "
                                f"{len(user_outs)} user outputs")
        out_name = user_outs[r.output]
        oval = out_by_name[out_name].meta.get("val") if out_name in out_by_name else None
        out_shape = _static_shape(oval, f"{where}.output {r.output}")
        if len(out_shape) != len(shape) or any(a != b for i, (a, b) in enumerate(zip(shape, out_shape)) if i != axis):
            raise ContractError(f"{where}.output: output {r.output} has shape {out_shape}, which does not match "
                                f"input {r.input!r} {shape} outside axis {axis}")
        for d in r.live:
            if not -len(shape) <= d < len(shape) or d % len(shape) == axis:
                raise ContractError(f"{where}.live: dim {d} is out of range or is the clock axis")
        live = tuple(sorted((d % len(shape), min(n, shape[d % len(shape)])) for d, n in r.live.items()))
        sites[r.name] = RegionSite(r, axis, shape, out_shape, val.dtype, val.device, live)
    _check_wrap_paths(ep, contract)
    return sites


def module_paths(node: Node) -> list[str]:
    """Module paths (outermost first) of the calls that produced ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _cls in stack.values()]


def _check_wrap_paths(ep: ExportedProgram, contract: Contract) -> None:
    seen: set[str] = set()
    for n in _all_nodes(ep.graph_module):
        seen.update(module_paths(n))
    for field_name, paths in (("wrap", contract.wrap), ("split_at", contract.split_at)):
        for w in paths:
            _check_path(field_name, w, seen)


def _all_nodes(gm: torch.nn.Module) -> Iterator[Node]:
    """Every node of ``gm``'s graph and of the subgraphs its higher-order ops call (an autocast or
    grad-mode block: the pipeline inlines them, so what they call is wrappable)."""
    for n in gm.graph.nodes:
        yield n
        if n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), torch.fx.GraphModule):
            yield from _all_nodes(getattr(gm, str(n.target)))


def _check_path(field_name: str, w: str, seen: set[str]) -> None:
    if w not in seen:
        near = sorted(p for p in seen if p and (w in p or p in w))[:5]
        raise ContractError(f"Contract.{field_name}: {w!r} matches no node's nn_module_stack"
                            + (f"; close paths: {near}" if near else "")
                            + " (a module entered through a method other than __call__ is not recorded)")
