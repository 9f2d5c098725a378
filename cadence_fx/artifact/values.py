"""The value codec: graph arguments, catalog keys and plan fields as JSON, and the contract, plan, region
sites and the passes' findings built on it.

Only the tagged kinds :func:`decode` knows come back (JSON scalars, node references, tuples, lists,
dicts, slices, dtypes, devices, layouts, memory formats); every value nests at most ``MAX_DEPTH``
levels, and a shape the manifest declares is at most 64 non-negative integers.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any, Callable, Mapping

import torch
from torch.fx import Node

from cadence_fx.annotations import JOURNAL_PREFIX, Finding
from cadence_fx.artifact.exceptions import ArtifactError
from cadence_fx.binding import RegionSite
from cadence_fx.contract import Clock, Contract, HeadTail, Phase, Region, Ring, SlidingWindow
from cadence_fx.passes import ProgramFacts
from cadence_fx.plan import Plan, RegionPlan
from cadence_fx.runtime.journal import JournalEntry, WriteJournal

__all__ = ["DTYPE_NAMES", "MAX_DEPTH", "STORED_FACTS", "canonical", "decode", "decode_contract", "decode_plan", "decode_site",
           "dtype_name", "encode", "encode_contract", "encode_facts", "encode_plan", "encode_site", "parse_dtype",
           "parse_ints", "parse_shape"]

# How deep a stored value (graph argument, key, plan field, pytree spec) may nest.
MAX_DEPTH = 64
_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo, torch.sparse_csr, torch._mkldnn)}  # type: ignore[attr-defined]
_FORMATS = {str(x): x for x in (torch.contiguous_format, torch.preserve_format, torch.channels_last,
                                torch.channels_last_3d)}


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


_DTYPES = {dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
DTYPE_NAMES = frozenset(_DTYPES)


def parse_dtype(name: str) -> torch.dtype:
    d = _DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise ArtifactError(f"unknown dtype {name!r}")
    return d


def encode(v: Any, depth: int = 0) -> Any:
    """A JSON value for a graph argument, a key or a plan field; tuples, floats and torch objects tagged."""
    if depth > MAX_DEPTH:
        raise ArtifactError(f"a value nested more than {MAX_DEPTH} levels deep")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):  # a node reference is "%name": a string that starts with % is escaped
        return {"str": v} if v.startswith("%") else v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, Node):
        return "%" + v.name
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v)}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v)}
    if isinstance(v, slice):
        return {"slice": [encode(x, depth + 1) for x in (v.start, v.stop, v.step)]}
    # tuples are JSON arrays, lists are tagged: graph arguments hold tens of thousands of tuples
    if isinstance(v, tuple):  # torch.Size included: a tuple of ints to every ATen schema
        return [encode(x, depth + 1) for x in v]
    if isinstance(v, list):  # immutable_list included
        return {"list": [encode(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if v is Ellipsis:
        return {"ellipsis": True}
    raise ArtifactError(f"cannot store a value of type {type(v).__name__}: {v!r}")


def decode(v: Any, env: Mapping[str, Node] | None = None,
         device_map: Callable[[torch.device], torch.device] | None = None, depth: int = 0) -> Any:
    """A value :func:`encode` wrote: JSON scalars, node references, and the tagged kinds only."""
    if depth > MAX_DEPTH:
        raise ArtifactError(f"a value nested more than {MAX_DEPTH} levels deep")
    if isinstance(v, list):
        return tuple(decode(x, env, device_map, depth + 1) for x in v)
    if isinstance(v, str) and v.startswith("%"):
        if env is None or v[1:] not in env:
            raise ArtifactError(f"a node refers to {v[1:]!r} before it is defined (corrupted graph)")
        return env[v[1:]]
    if not isinstance(v, dict):
        return v
    (tag, x), = v.items()
    if tag in ("list", "dict", "slice") and not isinstance(x, list) or tag in ("str", "float", "device") \
            and not isinstance(x, str):
        raise ArtifactError(f"malformed {tag} value {x!r}")
    if tag == "list":
        return [decode(y, env, device_map, depth + 1) for y in x]
    if tag == "str":
        return x
    if tag == "dict":
        return {decode(k, env, device_map, depth + 1): decode(y, env, device_map, depth + 1) for k, y in x}
    if tag == "float":
        return float(x)
    if tag == "dtype":
        return parse_dtype(x)
    if tag == "device":
        try:
            d = torch.device(x)
        except RuntimeError:
            raise ArtifactError(f"malformed device {x!r}") from None
        return device_map(d) if device_map is not None else d
    if tag in ("layout", "memory_format"):
        kinds = _LAYOUTS if tag == "layout" else _FORMATS
        if x not in kinds:
            raise ArtifactError(f"unknown {tag} {x!r}")
        return kinds[x]
    if tag == "slice":
        return slice(*(decode(y, env, device_map, depth + 1) for y in x))
    if tag == "ellipsis":
        return Ellipsis
    raise ArtifactError(f"unknown value tag {tag!r} (corrupted or newer artifact)")


def parse_ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(type(x) is int for x in v):
        raise ArtifactError(f"{v!r} is not a list of integers")
    return tuple(v)


def parse_shape(v: Any, what: str) -> tuple[int, ...]:
    """A shape the manifest declares: at most 64 non-negative integers."""
    if not isinstance(v, (list, tuple)) or len(v) > 64 or not all(type(x) is int and x >= 0 for x in v):
        raise ArtifactError(f"{what}: shape {v!r} is not a list of non-negative integers")
    return tuple(v)


def encode_site(site: RegionSite) -> dict[str, Any]:
    return {"region": site.region.name, "axis": site.axis, "shape": list(site.shape),
            "out_shape": list(site.out_shape), "dtype": dtype_name(site.dtype), "device": str(site.device),
            "live": [list(x) for x in site.live]}


def decode_site(d: Mapping[str, Any], contract: Contract, device: torch.device) -> RegionSite:
    return RegionSite(contract.region(d["region"]), d["axis"], tuple(d["shape"]), tuple(d["out_shape"]),
                      parse_dtype(d["dtype"]), device, tuple(tuple(x) for x in d["live"]))


# region states hold nodes and are the passes' own; the folded weights are stored on their own
STORED_FACTS = frozenset(f.name for f in fields(ProgramFacts)) - {"sites", "region_buffers", "regions",
                                                                    "folded_weights"}


def encode_facts(facts: ProgramFacts) -> dict[str, Any]:
    """The JSON-able findings (counts, byte tallies, notes); region states hold nodes and are the passes' own."""
    out = {}
    for f in fields(facts):
        if f.name not in STORED_FACTS:
            continue
        value = getattr(facts, f.name)
        if f.name == "left_stock":  # records: stored as the plain dicts they give
            value = [finding.to_dict() for finding in value]
        elif f.name == "journal":
            value = None if value is None else _journal_dict(value)
        try:
            out[f.name] = encode(value)
        except ArtifactError:
            continue  # a finding the runtime never reads back
    return out


def _journal_dict(j: WriteJournal) -> dict[str, Any]:
    """The undo journal with its view ops by name (``aten::select.int``)."""
    return {"flags": j.flags, "whole": sorted(j.whole),
            "entries": [{"region": e.region, "root": e.root, "kind": e.kind, "dim": e.dim, "old": e.old,
                         "index": e.index, "slot": e.slot,
                         "chain": [[_op_name(op), list(args), [list(kv) for kv in kwargs]] for op, args, kwargs in e.chain]}
                        for e in j.entries]}


def _op_name(op: Any) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def _view_op(name: Any) -> Any:
    """The ATen view op a stored journal names; anything else (an op that writes, allocates or is not
    ATen's) is refused: the journal replays these on the state."""
    if not isinstance(name, str) or not name.startswith("aten::") or name.count(".") != 1:
        raise ArtifactError(f"journal: {name!r} is not an ATen op name")
    base, overload = name.removeprefix("aten::").split(".")
    op = getattr(getattr(torch.ops.aten, base, None), overload, None)
    if not isinstance(op, torch._ops.OpOverload):
        raise ArtifactError(f"journal: {name!r} is not an ATen op")
    rets = op._schema.returns
    if not rets or op._schema.is_mutable or rets[0].alias_info is None or rets[0].alias_info.is_write:
        raise ArtifactError(f"journal: {name!r} is not a view op")
    return op


def _decode_journal(v: Any) -> WriteJournal | None:
    if v is None:
        return None
    try:
        entries = tuple(JournalEntry(
            region=str(e["region"]), root=_one_of(e["root"], ("input", "buffer")),
            chain=tuple((_view_op(op), tuple(args), tuple((str(k), x) for k, x in kwargs)) for op, args, kwargs in e["chain"]),
            kind=_one_of(e["kind"], ("view", "scatter_", "index_copy_", "index_fill_")),
            dim=None if e["dim"] is None else int(e["dim"]), old=_journal_attr(e["old"]),
            index=None if e["index"] is None else _journal_attr(e["index"]), slot=int(e["slot"]))
            for e in v["entries"])
        return WriteJournal(None if v["flags"] is None else _journal_attr(v["flags"]), entries,
                            frozenset(str(r) for r in v["whole"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"journal: not a journal ({type(e).__name__}: {e})") from None


def _one_of(v: Any, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise ArtifactError(f"journal: {v!r} is not one of {allowed}")
    return v


def _journal_attr(v: Any) -> str:
    if not isinstance(v, str) or not v.startswith(JOURNAL_PREFIX) or not v.replace("_", "").isalnum():
        raise ArtifactError(f"journal: {v!r} is not a journal buffer's name")
    return v


def decode_fact(name: str, value: Any) -> Any:
    """A stored finding as the program holds it (``left_stock``: :class:`Finding` records)."""
    value = decode(value)
    if name == "journal":
        return _decode_journal(value)
    if name != "left_stock":
        return value
    if not isinstance(value, list):
        raise ArtifactError(f"left_stock is a {type(value).__name__}, not a list of findings")
    try:
        return [Finding.from_dict(d) for d in value]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ArtifactError(f"left_stock holds a finding that is not one ({type(e).__name__}: {e})") from None


def encode_plan(plan: Plan) -> dict[str, Any]:
    return {"regions": [encode({f.name: getattr(r, f.name) for f in fields(r)}) for r in plan.regions],
            "classes": encode(plan.classes), "wrap": encode(plan.wrap), "notes": encode(plan.notes)}


def decode_plan(d: Mapping[str, Any]) -> Plan:
    return Plan(regions=tuple(RegionPlan(**decode(r)) for r in d["regions"]), classes=decode(d["classes"]),
                wrap=decode(d["wrap"]), notes=decode(d["notes"]))


def encode_contract(c: Contract) -> dict[str, Any]:
    """Everything of the contract but ``admit`` (code): its verdict per class is stored instead."""
    def retention(p: Any) -> list[Any]:
        if isinstance(p, HeadTail):
            return ["HeadTail", p.head, p.tail]
        if isinstance(p, SlidingWindow):
            return ["SlidingWindow", p.size]
        return ["Ring", p.capacity]

    return {
        "clocks": [[k.name, k.stride, k.unit] for k in c.clocks],
        "regions": [{"name": r.name, "input": r.input, "output": r.output, "clock": r.clock, "axis": r.axis,
                     "order": r.order, "retention": retention(r.retention), "initial": r.initial, "growth": r.growth,
                     "live": sorted([int(d), int(n)] for d, n in dict(r.live).items())} for r in c.regions],
        "wrap": list(c.wrap), "split_at": list(c.split_at), "admit": c.admit is not None,
        "hoist_constants": c.hoist_constants, "fold_weights": c.fold_weights,
        "phase": None if c.phase is None else {"input": c.phase.input, "at": list(c.phase.at)},
    }


def decode_contract(d: Mapping[str, Any]) -> Contract:
    kinds = {"HeadTail": HeadTail, "SlidingWindow": SlidingWindow, "Ring": Ring}
    regions = tuple(Region(r["name"], input=r["input"], output=r["output"], clock=r["clock"], axis=r["axis"],
                           order=r["order"], retention=kinds[r["retention"][0]](*r["retention"][1:]),
                           initial=r["initial"], growth=r["growth"], live={dd: n for dd, n in r["live"]})
                    for r in d["regions"])
    return Contract(clocks=tuple(Clock(*k) for k in d["clocks"]), regions=regions, wrap=tuple(d["wrap"]),
                    split_at=tuple(d["split_at"]), hoist_constants=d["hoist_constants"],
                    fold_weights=d["fold_weights"],
                    phase=None if d.get("phase") is None else Phase(d["phase"]["input"], tuple(d["phase"]["at"])))


def canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True)
