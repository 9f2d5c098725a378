"""Graph passes. One pass per module, each ``(GraphModule, PassContext) -> GraphModule``.

The order they run in is stated once, in :mod:`cadence_fx.pipeline`, which also regenerates the
module's code once after the last pass (a pass edits the graph; only ``partition`` needs current code).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx import Node

from cadence_fx.binding import RegionSite
from cadence_fx.contract import Contract
from cadence_fx.plan import Plan

log = logging.getLogger("cadence_fx.passes")


@dataclass
class RegionState:
    """Per-program facts the state passes share about one region."""

    buffer_attr: str  # attribute name of the contract-owned flat buffer on the GraphModule
    placeholder: Node
    carry: Node | None = None  # view of the buffer holding history + new positions (in-place append)
    carry_extent: int | None = None


@dataclass
class PassContext:
    """What every pass may read: the contract, its plan, this program's region sites, and settings."""

    contract: Contract
    plan: Plan
    sites: dict[str, RegionSite]
    region_buffers: dict[str, torch.Tensor]
    verify: bool = False
    state_rule: bool = True  # off: regions stay as the program allocates them (the paper's R cells)
    auditor: Any = None
    make_runner: Callable[..., Any] | None = None
    regions: dict[str, RegionState] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)
    runners: dict[str, Any] = field(default_factory=dict)
    demand: dict[str, tuple] = field(default_factory=dict)  # workspace -> (stock shape, demand shape)
    # one demand-sized copy per stock workspace, shared by every program of one optimized program
    shared_workspaces: dict[tuple, dict] = field(default_factory=dict)
    # hoisted constants by value, shared by every program of one optimized program
    shared_constants: dict[tuple, list] = field(default_factory=dict)
    folded_weights: Any = None  # hoist_constants.FoldedWeights: the weights this program folded

    def record(self, pass_name: str, count: int) -> None:
        self.changed[pass_name] = self.changed.get(pass_name, 0) + count
        log.info("%s: %d node(s) changed", pass_name, count)
