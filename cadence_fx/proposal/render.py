"""A proposed contract as Python a user can paste, and its evidence as comments under it.

The code names everything through ``cf.`` (``import cadence_fx as cf`` is its first line), so it
runs as it is printed and evaluates to a contract equal to the proposal's; a region this cadence_fx
cannot construct yet is printed commented out, with the reason, so it is not lost.
"""

from __future__ import annotations

import textwrap
from typing import Any, Iterable, Mapping, Sequence

from cadence_fx.contract import WHOLE_STEP, Contract, Region

_WIDTH = 110
_REGION_FIELDS = ("input", "output", "clock", "axis", "order")


def render_code(contract: Contract, pending: Sequence[tuple[Mapping[str, Any], str]] = ()) -> str:
    """``contract`` as ``contract = cf.Contract(...)``; ``pending``: (Region fields, why not constructed)."""
    clocks = _tuple(f"cf.Clock({c.name!r}, {c.stride})" for c in contract.clocks)
    lines = ["import cadence_fx as cf", "", "contract = cf.Contract(", f"    clocks={clocks},"]
    lines.append("    regions=(" if contract.regions or pending else "    regions=(),")
    for r in contract.regions:
        lines.append(f"        {_region(region_fields(r))},")
    for fields, why in pending:
        lines += [f"        # {line}" for line in f"{_region(fields)},".splitlines()]
        lines += textwrap.wrap(f"not accepted by this cadence_fx: {why}", _WIDTH - 10,
                               initial_indent="        #   ", subsequent_indent="        #   ")
    if contract.regions or pending:
        lines.append("    ),")
    wrap = _tuple("cf.WHOLE_STEP" if w == WHOLE_STEP else repr(w) for w in contract.wrap)
    lines += [f"    wrap={wrap},", ")"]
    return "\n".join(lines) + "\n"


def _tuple(items: Iterable[str]) -> str:
    parts = list(items)
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def region_fields(r: Region) -> dict[str, Any]:
    """The fields a proposal sets on ``r`` (never ``live``), as ``Region(**fields)`` takes them."""
    out: dict[str, Any] = {"name": r.name}
    out.update({f: getattr(r, f) for f in _REGION_FIELDS})
    out.update(retention=r.retention, initial=r.initial, growth=r.growth)
    return out


def _region(fields: Mapping[str, Any]) -> str:
    head = ", ".join(f"{f}={fields[f]!r}" for f in _REGION_FIELDS)
    tail = f"retention=cf.{fields['retention']!r}, initial={fields['initial']}"
    if fields.get("growth") is not None:
        tail += f", growth={fields['growth']}"
    return f"cf.Region({fields['name']!r}, {head},\n{' ' * 18}{tail})"


def render_evidence(evidence: Mapping[str, Sequence[str]], notes: Sequence[str]) -> str:
    """The evidence as comment lines: one block per region (or input considered), then the notes."""
    lines = ["# evidence"]
    for key, sentences in list(evidence.items()) + ([("stream", notes)] if notes else []):
        lines.append(f"# {key}:")
        for s in sentences:
            lines += textwrap.wrap(s, _WIDTH, initial_indent="#   - ", subsequent_indent="#     ")
    return "\n".join(lines) + "\n"
