"""cadence_fx: exact state and exact-shape replay for streaming ``torch.export`` programs.

    prog = cadence_fx.optimize(exported_program, contract)   # drop-in for exported_program.module()
"""

from cadence_fx.audit import RetentionMismatch
from cadence_fx.contract import Clock, Contract, ContractError, HeadTail, Region, Ring, SlidingWindow
from cadence_fx.passes.hoist_constants import WeightsChanged
from cadence_fx.plan import Plan, call_classes, plan, region_extents
from cadence_fx.program import CatalogMiss, OptimizedProgram, optimize

__all__ = [
    "CatalogMiss", "Clock", "Contract", "ContractError", "HeadTail", "OptimizedProgram", "Plan", "Region",
    "RetentionMismatch", "Ring", "SlidingWindow", "WeightsChanged", "call_classes", "optimize", "plan",
    "region_extents",
]
__version__ = "0.1.0"
