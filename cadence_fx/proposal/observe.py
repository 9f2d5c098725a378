"""Replaying a recorded stream through the eager step: what each call returned, what it concatenated.

The recorded calls are the only ground truth about how the user's driver feeds state back, so every
call is replayed on clones of its recorded inputs (a step may write an input in place) and its outputs
are cloned at once (a step may return a view of a module buffer the next call overwrites). The
step's module buffers are put back as they were when the replay ends: proposing a contract must not
advance the stream the caller holds.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from cadence_fx.contract import ContractError

# the spellings of one concatenation; ``concatenate`` names its dim ``axis``
_CATS = (torch.cat, torch.concat, torch.concatenate)


@dataclass(frozen=True)
class SeenCat:
    """One concatenation the eager step made with a state input among its operands."""

    dim: int  # non-negative
    position: int  # operand index of the state
    operands: int
    added: int  # positions the other operands contributed along ``dim``
    value: torch.Tensor  # the result, cloned


@dataclass
class Stream:
    """The replayed stream: per call its recorded inputs, the eager outputs (flat), the cats seen."""

    keys: list[str]  # the caller's names of the inputs (dict keys, or the exported names for tuples)
    inputs: list[list[Any]]
    outputs: list[list[Any]] = field(default_factory=list)
    cats: list[dict[int, list[SeenCat]]] = field(default_factory=list)  # per call: input index -> cats
    buffers: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # fqn -> value before each call, then after
    by_keyword: bool = False  # the step is called with the inputs by name (as recorded), not by position

    @property
    def calls(self) -> int:
        return len(self.inputs)

    def call(self, k: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Call ``k``'s inputs, cloned, as (args, kwargs) for the step (and ``torch.export.export``)."""
        values = clone_args(self.inputs[k])
        return ((), dict(zip(self.keys, values))) if self.by_keyword else (tuple(values), {})


def normalize_calls(step: torch.nn.Module, calls: Sequence[Mapping[str, Any] | Sequence[Any]]) -> Stream:
    """The calls as positional lists, checked for one signature; at least 3 of them."""
    if len(calls) < 3:
        raise ValueError(f"propose_contract: needs at least 3 recorded calls (2 transitions), got {len(calls)}")
    if step.training:
        raise ValueError("propose_contract: the step is in training mode; call step.eval() first "
                         "(dropout and batch statistics would make the replay differ from the recording)")
    if all(isinstance(c, Mapping) for c in calls):
        keys = list(calls[0])
        for k, c in enumerate(calls):
            if list(c) != keys:
                raise ValueError(f"propose_contract: call {k} has inputs {list(c)}, call 0 has {keys}")
        return Stream(keys, [list(c.values()) for c in calls if isinstance(c, Mapping)],
                      by_keyword=_by_keyword(step, keys))
    if any(isinstance(c, Mapping) for c in calls):
        raise ValueError("propose_contract: calls mix dicts and tuples; record every call the same way")
    n = len(calls[0])
    if any(len(c) != n for c in calls):
        raise ValueError(f"propose_contract: calls have different numbers of inputs {[len(c) for c in calls]}")
    return Stream(_parameter_names(step, n), [list(c) for c in calls])


def _parameter_names(step: torch.nn.Module, n: int) -> list[str]:
    # placeholder names torch.export would give; replaced by the exported names once exported
    try:
        params = [p.name for p in inspect.signature(step.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:n] + [f"args_{i}" for i in range(len(params), n)]


def _by_keyword(step: torch.nn.Module, keys: list[str]) -> bool:
    """Whether dict calls must be made by keyword: their keys are ``forward``'s parameter names but not its
    first positional ones in order (``forward(input_ids=None, inputs_embeds=None, cache_position=None)``
    recorded as ``{"input_ids": ..., "cache_position": ...}``)."""
    try:
        params = list(inspect.signature(step.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return set(keys) <= named and keys != positional[:len(keys)]


def clone_args(values: Sequence[Any]) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


class _CatWatch(TorchFunctionMode):
    """Records every ``torch.cat`` that takes one of ``tracked`` (the call's state inputs) as an operand."""

    def __init__(self, tracked: Mapping[int, torch.Tensor]) -> None:
        super().__init__()
        self.tracked = tracked
        self.seen: dict[int, list[SeenCat]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _CATS and isinstance(result, torch.Tensor):
            # a legacy-empty operand (``torch.tensor([])``) is skipped by torch.cat; a cat of one is a copy
            parts = [t for t in (args[0] if args else kwargs.get("tensors", ()))
                     if not (isinstance(t, torch.Tensor) and t.shape == (0,))]
            if len(parts) < 2:
                return result
            dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
            dim = dim % result.dim() if result.dim() else 0
            for i, state in self.tracked.items():
                pos = next((p for p, t in enumerate(parts) if _same_tensor(t, state)), None)
                if pos is not None:
                    added = result.shape[dim] - state.shape[dim] if state.dim() == result.dim() else 0
                    self.seen.setdefault(i, []).append(SeenCat(dim, pos, len(parts), added, result.clone()))
        return result


def _same_tensor(t: object, state: torch.Tensor) -> bool:
    # a ``.contiguous()`` or ``.detach()`` of the input is the input for the cat's purpose
    if t is state:
        return True
    return (isinstance(t, torch.Tensor) and t.numel() > 0 and t.data_ptr() == state.data_ptr()
            and t.shape == state.shape and t.stride() == state.stride())


@contextmanager
def buffers_kept(step: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The step's module buffers by name (a shared one under each of its names, as export names it),
    put back as they were on exit, whatever happened inside."""
    own = dict(step.named_buffers(remove_duplicate=False))
    saved = {name: b.detach().clone() for name, b in own.items()}
    leaves = {name for name, b in own.items() if b.is_leaf and not b.requires_grad}
    try:
        yield own
    finally:
        with torch.no_grad():
            for name, b in own.items():
                if name in leaves and not (b.is_leaf and not b.requires_grad):
                    # a non-strict export that wrote a buffer it lifted as a constant leaves it with autograd
                    # history (a deepcopy of a program holding it then fails): a plain tensor again
                    try:
                        b.detach_()
                        b.requires_grad_(False)
                    except RuntimeError:  # a view: its base carries the history; the values are put back below
                        pass
                b.copy_(saved[name])


def replay(step: torch.nn.Module, stream: Stream, watched: Sequence[int], buffers: Sequence[str]) -> None:
    """Run every call eagerly, recording outputs, the cats of inputs ``watched`` and the values of
    module buffers ``buffers``; the step's buffers are restored afterwards."""
    with buffers_kept(step) as own, torch.no_grad():
        buffers = [fqn for fqn in buffers if fqn in own]
        for k in range(stream.calls):
            for fqn in buffers:
                stream.buffers.setdefault(fqn, []).append(own[fqn].detach().clone())
            args, kwargs = stream.call(k)
            given = list(args) + list(kwargs.values())
            watch = _CatWatch({i: given[i] for i in watched if isinstance(given[i], torch.Tensor)})
            try:
                with watch:
                    out = step(*args, **kwargs)
            except Exception as e:
                raise ContractError(f"propose_contract: the eager step raised at call {k}: "
                                    f"{type(e).__name__}: {e}") from e
            stream.outputs.append([t.clone() if isinstance(t, torch.Tensor) else t
                                   for t in pytree.tree_leaves(out)])
            stream.cats.append(watch.seen)
        for fqn in buffers:
            stream.buffers[fqn].append(own[fqn].detach().clone())


def same_value(a: object, b: object) -> bool:
    """``torch.equal`` that also requires the same dtype and shape (equal values of another dtype: no feed-back)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.device == b.device and torch.equal(a, b))


@dataclass(frozen=True)
class FedBack:
    """Input ``input`` of each call is output ``output`` of the call before."""

    input: int
    output: int
    also: tuple[int, ...] = ()  # other outputs that were equal too (the first unclaimed one is taken)


def fed_back(stream: Stream) -> tuple[list[FedBack], dict[int, str]]:
    """The state inputs (each matched to the first output it equals at every transition) and, for
    every other input with an output of its shape and dtype at some call, why it is not one."""
    n = stream.calls
    found: list[FedBack] = []
    why: dict[int, str] = {}
    claimed: set[int] = set()
    for i, _ in enumerate(stream.keys):
        if not isinstance(stream.inputs[0][i], torch.Tensor):
            continue
        equal = [j for j in range(len(stream.outputs[0]))
                 if all(same_value(stream.inputs[k + 1][i], stream.outputs[k][j]) for k in range(n - 1))]
        free = [j for j in equal if j not in claimed]
        if free:
            claimed.add(free[0])
            found.append(FedBack(i, free[0], tuple(j for j in equal if j != free[0])))
            continue
        close = _closest(stream, i)
        if close is not None:
            why[i] = close
    return found, why


def _closest(stream: Stream, i: int) -> str | None:
    """A sentence on why input ``i`` is no state, if some output had its shape and dtype (else None)."""
    n, name = stream.calls, stream.keys[i]
    best: tuple[int, int, int] | None = None  # (transitions equal, output, first differing call)
    for j in range(len(stream.outputs[0])):
        shaped = [k for k in range(n - 1) if _alike(stream.inputs[k + 1][i], stream.outputs[k][j])]
        if not shaped:
            continue
        equal = [k for k in shaped if same_value(stream.inputs[k + 1][i], stream.outputs[k][j])]
        first = next(k for k in range(n - 1) if not same_value(stream.inputs[k + 1][i], stream.outputs[k][j]))
        if best is None or len(equal) > best[0]:
            best = (len(equal), j, first)
    if best is None:
        return None
    count, j, first = best
    return (f"input {name!r} is not fed back: at call {first + 1} it is not torch.equal to any output of call "
            f"{first} (output {j} has its shape and dtype, and was equal at {count or 'none'} of the {n - 1} "
            "transitions); "
            "no region proposed for it")


def changed_positions(old: torch.Tensor, new: torch.Tensor, axis: int) -> list[int]:
    """The indices along ``axis`` at which ``new`` differs from ``old`` anywhere in the other dims."""
    diff = (old != new).movedim(axis, 0).reshape(old.shape[axis], -1).any(1)
    return [int(i) for i in diff.nonzero().flatten()]


def _alike(a: object, b: object) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
