"""cadence_fx: exact state and exact-shape replay for streaming ``torch.export`` programs.

    eps = cadence_fx.export_catalog(step, contract, example)  # one static program per catalog class
    prog = cadence_fx.optimize(eps, contract)                  # drop-in for ep.module()
    cadence_fx.save(prog, "step.cfx")                          # a restart: cadence_fx.load("step.cfx")
"""

import logging

from cadence_fx.runtime.audit import RetentionMismatch
from cadence_fx.contract import (WHOLE_STEP, Clock, Contract, ContractError, HeadTail, Phase, Region, Ring,
                                 SlidingWindow)
from cadence_fx.export import example_inputs, export_catalog
from cadence_fx.runtime.weights import WeightsChanged
from cadence_fx.runtime.process_weights import WeightsNotShared, map_weights, publish_weights
from cadence_fx.plan import Plan, call_classes, format_traffic, plan, region_extents, state_traffic
from cadence_fx.program import OptimizedProgram, optimize
from cadence_fx.proposal import Proposal, propose_contract
from cadence_fx.runtime.backends import CudaGraphBackend
from cadence_fx.artifact import ArtifactError, ArtifactMismatch, load, save
from cadence_fx.runtime.catalog import CatalogMiss, reference
from cadence_fx.runtime.sessions import Session, SessionClosed, Snapshot
from cadence_fx.runtime.errors import NoLaneToPin, StaleState, StateMismatch
from cadence_fx.runtime.state import state_to

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "ArtifactError", "ArtifactMismatch", "CatalogMiss", "Clock", "Contract", "ContractError", "CudaGraphBackend",
    "HeadTail",
    "OptimizedProgram", "Phase", "Plan", "Proposal", "Region",
    "RetentionMismatch", "Ring", "Session", "NoLaneToPin", "SessionClosed", "SlidingWindow", "Snapshot", "StaleState", "StateMismatch", "WHOLE_STEP", "WeightsChanged", "WeightsNotShared", "call_classes",
    "example_inputs", "export_catalog", "format_traffic", "load", "map_weights", "optimize", "plan", "propose_contract", "publish_weights", "reference", "region_extents", "save", "state_to", "state_traffic",
]
__version__ = "0.1.0"
