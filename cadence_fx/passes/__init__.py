"""Graph passes. One pass per module, each ``(GraphModule, PassContext) -> GraphModule``.

The order they run in is stated once, in :mod:`cadence_fx.pipeline`, which also regenerates the
module's code once after the last pass (a pass edits the graph; only ``partition`` needs current code).
Passes end at annotated graphs (:mod:`cadence_fx.annotations`): nothing here runs or replays.

The context a pass sees has three parts: the frozen :class:`PassConfig` (the same for every
program of one ``optimize``), the :class:`CatalogTables` every program of the catalog shares (one
buffer per hoisted value, one copy per workspace), and this program's :class:`ProgramFacts`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from cadence_fx.annotations import Finding
from cadence_fx.binding import RegionSite
from cadence_fx.contract import Contract
from cadence_fx.runtime.workspaces import CatalogTables

if TYPE_CHECKING:
    from cadence_fx.runtime.audit import Auditor
    from cadence_fx.passes.journal_writes import WriteJournal
    from cadence_fx.runtime.weights import FoldedWeights

log = logging.getLogger("cadence_fx.passes")


@dataclass(frozen=True)
class PassConfig:
    """Settings fixed for one ``optimize`` call."""

    contract: Contract
    state_rule: bool = True  # off: regions stay as the program allocates them (the paper's R cells)
    verify: bool = False     # shadow-run the stock concatenations and compare (needs the state rule)
    auditor: "Auditor | None" = None
    journal: bool = False    # save what each write into a region overwrites (passes.journal_writes)


@dataclass
class RegionState:
    """What the state passes share about one region of one program."""

    buffer_attr: str  # attribute name of the contract-owned flat buffer on the GraphModule
    placeholder: Node
    carry: Node | None = None  # view of the buffer holding history + new positions (in-place append)
    # envelope layout: the buffer viewed as the envelope shape (passes.envelope_state); a state of
    # extent T is its narrow(axis, 0, T)
    envelope: Node | None = None


@dataclass
class ProgramFacts:
    """Per-program inputs and findings: the region sites and buffers in, what the passes found out."""

    sites: dict[str, RegionSite]
    region_buffers: dict[str, torch.Tensor]
    regions: dict[str, RegionState] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)
    folded_weights: "FoldedWeights | None" = None
    # region -> {"stock": bytes, "optimized": bytes}: state bytes one call writes
    # (analysis.traffic.state_bytes_written; None: a value on the way could not be sized)
    state_bytes: dict[str, dict[str, int | None]] = field(default_factory=dict)
    # patterns a state pass recognised but could not prove exact: left as the stock program has them
    left_stock: list[Finding] = field(default_factory=list)
    # what a call writes into its regions, journaled for the undo (passes.journal_writes); None: not run
    journal: "WriteJournal | None" = None

    def leave_stock(self, pattern: str, subject: str, reason: str) -> None:
        """Record that a pass left ``pattern`` (a finding kind of :mod:`cadence_fx.annotations`) stock for
        ``subject`` (a region, or a workspace attribute), and why."""
        self.left_stock.append(Finding(pattern, subject, reason, tuple((n, s.extent) for n, s in self.sites.items())))


@dataclass
class PassContext:
    """What every pass may read and record."""

    config: PassConfig
    tables: CatalogTables
    program: ProgramFacts

    @property
    def contract(self) -> Contract:
        return self.config.contract

    def record(self, pass_name: str, count: int) -> None:
        self.program.changed[pass_name] = self.program.changed.get(pass_name, 0) + count
        log.info("%s: %d node(s) changed", pass_name, count)
