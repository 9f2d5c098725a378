"""The catalog: one exported program per exact input signature, and the dispatch between them.

A streaming step exported with static shapes is one program per catalog class (the extents
:func:`cadence_fx.plan.call_classes` lists). A call picks its program by the exact signature of
its arguments: every tensor's shape and dtype, every other argument's type. Nothing is padded or
bucketed; a call that no program covers raises :class:`CatalogMiss`, which names the argument that
differs from the nearest class and how.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

import torch
from torch.export import ExportedProgram

from cadence_fx.binding import input_names

__all__ = ["ArgKey", "Catalog", "CatalogMiss", "arg_key", "input_names", "program_key", "reference"]

V = TypeVar("V")
ArgKey = tuple  # ("T", shape, dtype) for a tensor, ("S", type name[, value]) for anything else
Rekey = Mapping[int, Mapping[int, tuple[int, int]]]  # input index -> {dim: (live size, stock size)}


class CatalogMiss(RuntimeError):
    """A call whose input signature no exported program of the catalog covers."""


_VALUED = (bool, int, float, str, type(None))  # export specializes these to the value it saw


def arg_key(a: Any) -> ArgKey:
    """What of one argument selects a program: shape and dtype of a tensor, type and value of a Python
    scalar (export bakes the value it saw into the program), the type of anything else."""
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype)
    if type(a) in _VALUED:
        return ("S", type(a).__name__, a)
    return ("S", type(a).__name__)


def program_key(ep: ExportedProgram) -> tuple[ArgKey, ...]:
    """The signature ``ep`` was exported at (static shapes; a symbolic size keys as itself)."""
    phs = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for name in input_names(ep):
        val = phs[name].meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append(("T", tuple(int(s) if isinstance(s, int) else s for s in val.shape), val.dtype))
        elif type(val) in _VALUED:
            out.append(("S", type(val).__name__, val))
        else:  # a symbolic scalar: any value of its type
            out.append(("S", "int" if isinstance(val, torch.SymInt) else type(val).__name__))
    return tuple(out)


class Catalog(Generic[V]):
    """Exact-signature dispatch over one entry per exported program.

    ``rekey`` lets a live-sized argument select the program exported at the stock size: a state
    region whose dead capacity the optimized program does not store (``Region.live``) arrives with
    ``live`` positions on a dim the program was exported with ``stock`` positions on.
    """

    def __init__(self, names: Sequence[str], entries: Sequence[tuple[tuple[ArgKey, ...], V]], *,
                 rekey: Rekey | None = None, phase: "tuple[int, Callable[[int], int]] | None" = None) -> None:
        self.names = list(names)
        # (input index, value -> phase): programs of one signature told apart by a scalar input's value
        self._phase = phase
        self._rekey = {i: dict(d) for i, d in (rekey or {}).items()}
        self._table: dict[tuple[ArgKey, ...], V] = {}
        # positions where some program takes any value of a scalar's type: keyed by type there
        self._by_type = {i for key, _v in entries for i, k in enumerate(key) if k[0] == "S" and len(k) == 2}
        for key, value in entries:
            if key in self._table:
                hint = (" and the same phase" if phase is not None else
                        "; if they are phases of one step (a first call, a prefill), declare Contract.phase")
                raise ValueError(f"two exported programs share the input signature "
                                 f"{describe_key(self.names, key)}{hint}")
            self._table[key] = value

    @classmethod
    def of_programs(cls, eps: Sequence[ExportedProgram], value: Callable[[ExportedProgram], V], *,
                    rekey: Rekey | None = None) -> "Catalog[V]":
        """One entry ``value(ep)`` per program, keyed by the signature it was exported at."""
        if not eps:
            raise ValueError("a catalog needs at least one exported program")
        return cls(input_names(eps[0]), [(program_key(ep), value(ep)) for ep in eps], rekey=rekey)

    def key(self, args: Sequence[Any]) -> tuple[ArgKey, ...]:
        key = [arg_key(a) for a in args]
        for i in self._by_type:
            if i < len(key) and key[i][0] == "S":
                key[i] = key[i][:2]
        for i, dims in self._rekey.items():
            if i < len(key) and key[i][0] == "T":
                shape = list(key[i][1])
                for d, (live, stock) in dims.items():
                    if d < len(shape) and shape[d] == live:
                        shape[d] = stock
                key[i] = ("T", tuple(shape), key[i][2])
        if self._phase is not None:
            key.append(("P", phase_of(args, *self._phase)))
        return tuple(key)

    def lookup(self, args: Sequence[Any]) -> V:
        """The entry for ``args``; :class:`CatalogMiss` naming the nearest class's difference otherwise."""
        return self.find(args)[1]

    def find(self, args: Sequence[Any]) -> tuple[tuple[ArgKey, ...], V]:
        """``(key, entry)`` for ``args``: the key also selects the same class in a catalog of another lane."""
        key = self.key(args)
        hit = self._table.get(key)
        if hit is None:
            raise CatalogMiss(self.explain(key))
        return key, hit

    def explain(self, key: tuple[ArgKey, ...]) -> str:
        """Why ``key`` misses: each difference from the nearest class, by argument name."""
        if not self._table:
            return "the catalog is empty"
        nearest = min(self._table, key=lambda k: (len(differences(self.names, key, k)), _distance(key, k)))
        diffs = differences(self.names, key, nearest)
        lines = [f"no exported program covers this call ({len(self._table)} catalog class(es)); "
                 f"nearest class differs in {len(diffs)} argument(s):"]
        lines += [f"  - {d}" for d in diffs]
        lines.append("export one program per catalog class (cadence_fx.call_classes lists them), or feed "
                     "the state the previous call returned")
        return "\n".join(lines)

    def __getitem__(self, key: tuple[ArgKey, ...]) -> V:
        return self._table[key]

    def __contains__(self, key: object) -> bool:
        return key in self._table

    def __iter__(self) -> Iterator[tuple[ArgKey, ...]]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def items(self) -> Iterator[tuple[tuple[ArgKey, ...], V]]:
        return iter(self._table.items())

    def values(self) -> Iterator[V]:
        return iter(self._table.values())


def phase_of(args: Sequence[Any], index: int, rule: Callable[[int], int]) -> int:
    """The phase of a call (or an export's example inputs) by the value of its scalar input ``index``."""
    v = args[index] if index < len(args) else None
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_floating_point and not v.is_complex():
        return rule(int(v.item()))
    if isinstance(v, int) and not isinstance(v, bool):
        return rule(v)
    raise CatalogMiss(f"the phase input (argument {index}) must be an int or a one-element integer tensor, got "
                      f"{type(v).__name__}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")


def differences(names: Sequence[str], got: Sequence[ArgKey], want: Sequence[ArgKey]) -> list[str]:
    """Readable differences between a call's key and a catalog class's key."""
    out = []
    if len(got) != len(want):
        out.append(f"{len(got)} arguments given, the program takes {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        name = repr(names[i]) if i < len(names) else f"#{i}"
        if g == w:
            continue
        if g[0] == w[0] == "P":
            out.append(f"phase {g[1]} (by the phase input's value) where this program is phase {w[1]}")
            continue
        if g[0] != w[0]:
            what = {"T": "a tensor", "S": "a Python value"}
            got_s = what[g[0]] + ("" if g[0] == "T" else f" ({g[1]})")
            out.append(f"argument {name}: {got_s} where {what[w[0]]} was exported")
        elif g[0] == "S":
            if g[1] != w[1]:
                out.append(f"argument {name}: type {g[1]} where {w[1]} was exported")
            else:
                out.append(f"argument {name}: value {g[2:]!r} where the program was exported with {w[2:]!r} "
                           "(export bakes a Python scalar's value into the program)")
        else:
            (gs, gd), (ws, wd) = g[1:], w[1:]
            if gd != wd:
                out.append(f"argument {name}: dtype {gd} where {wd} was exported")
            if len(gs) != len(ws):
                out.append(f"argument {name}: rank {len(gs)} {tuple(gs)} where rank {len(ws)} {tuple(ws)} was exported")
            else:
                axes = [f"axis {d}: {a} instead of {b}" for d, (a, b) in enumerate(zip(gs, ws)) if a != b]
                if axes:
                    out.append(f"argument {name}: shape {tuple(gs)} differs on " + ", ".join(axes))
    return out


def describe_key(names: Sequence[str], key: Sequence[ArgKey]) -> str:
    parts = []
    for i, k in enumerate(key):
        name = names[i] if i < len(names) else f"#{i}"
        if k[0] == "P":
            parts.append(f"phase {k[1]}")
            continue
        parts.append(f"{name}: {tuple(k[1])} {k[2]}" if k[0] == "T" else f"{name}: {k[1]}")
    return "(" + ", ".join(parts) + ")"


def _distance(got: Sequence[ArgKey], want: Sequence[ArgKey]) -> int:
    total = 0
    for g, w in zip(got, want):
        if g[0] == w[0] == "T" and len(g[1]) == len(w[1]):
            total += sum(abs(int(a) - int(b)) for a, b in zip(g[1], w[1]) if isinstance(a, int) and isinstance(b, int))
    return total


def _keyword_names(ep: ExportedProgram) -> list[str]:
    """The keywords ``ep`` was exported with, in calling order (its inputs after the positional ones)."""
    spec = ep.call_spec.in_spec
    if spec is None or spec.num_children != 2:
        return []
    kwargs = spec.child(1)
    return list(kwargs.context) if kwargs.context else []


def reference(eps: ExportedProgram | Sequence[ExportedProgram]) -> Callable[..., Any]:
    """The unmodified programs behind one callable: ``ep.module()`` of the matching signature, run
    under ``no_grad`` as an inference step runs (the baseline every optimized output is compared with)."""
    eps = [eps] if isinstance(eps, ExportedProgram) else list(eps)
    cat = Catalog.of_programs(eps, lambda ep: (ep.module(), _keyword_names(ep)))

    def call(*args: Any, **kwargs: Any) -> Any:
        flat = list(args) + [kwargs.pop(n) for n in cat.names[len(args):] if n in kwargs]
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}; inputs are {cat.names}")
        mod, keywords = cat.lookup(flat)
        n = len(flat) - len(keywords)  # a program exported with keyword inputs takes them by keyword
        with torch.no_grad():
            return mod(*flat[:n], **dict(zip(keywords, flat[n:])))

    call.catalog = cat  # type: ignore[attr-defined]
    return call
