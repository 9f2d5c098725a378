"""Verify mode: the stock concatenation is shadow-computed and compared with the in-place result."""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import has_side_effect

from cadence_fx.annotations import AUDITOR_ATTR
from cadence_fx.determinism import byte_view


class RetentionMismatch(AssertionError):
    """The in-place state disagrees with the concatenation it replaced (the declaration is wrong)."""


class Auditor:
    """Counts calls and audits; ``check`` raises on the first element that differs."""

    def __init__(self) -> None:
        self.call = 0
        self.checks = 0

    def check(self, region: str, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        self.checks += 1
        if actual.shape != expected.shape:
            raise RetentionMismatch(f"region {region!r}, call {self.call}, {what}: shape {tuple(actual.shape)} "
                                    f"!= stock {tuple(expected.shape)}")
        # bitwise comparison: NaNs with equal payloads count as equal, -0.0 and 0.0 do not
        a = byte_view(actual) if actual.numel() else actual
        e = byte_view(expected) if expected.numel() else expected
        if not torch.equal(a, e):
            flat = (a != e).nonzero()
            byte = int(flat[0]) if flat.numel() else 0
            idx = byte // actual.element_size()
            pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), actual.shape))
            raise RetentionMismatch(
                f"region {region!r}, call {self.call}, {what}: first differing element at {pos}: "
                f"{actual.reshape(-1)[idx].item()!r} != stock {expected.reshape(-1)[idx].item()!r}")


@has_side_effect
def audit(auditor: Auditor, region: str, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Graph-side hook (kept alive by dead-code elimination) that calls ``auditor.check``."""
    auditor.check(region, what, actual, expected)


def auditor_node(gm: GraphModule, auditor: Auditor) -> Node:
    """A ``get_attr`` node for the program's auditor (FX can only reference objects through attributes)."""
    if not hasattr(gm, AUDITOR_ATTR):
        setattr(gm, AUDITOR_ATTR, auditor)
    with warnings.catch_warnings():  # FX warns for attributes that are not tensors or modules
        warnings.simplefilter("ignore")
        return gm.graph.get_attr(AUDITOR_ATTR)
