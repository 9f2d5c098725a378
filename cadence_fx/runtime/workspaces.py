"""What the programs of one catalog share as they are built: workspace copies, hoisted constants, digests.

The passes fill these tables program by program (``shrink_workspace`` grows a workspace copy to the
union of the boxes every program reaches); the runtime then rebinds every program to the final copy
and frees the outgrown ones, and a lane copy or a loaded artifact reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

__all__ = ["CatalogTables", "SharedWorkspace", "rebind_shared_workspaces", "release_stale_workspaces"]


@dataclass
class SharedWorkspace:
    """One demand-sized copy of a program-owned workspace, shared by every program of a catalog."""

    stock: torch.Tensor | None  # the user's workspace (dropped once every program is built)
    bounds: list[int]           # the union of the boxes the programs reach
    tensor: torch.Tensor | None = None
    stale: list[torch.Tensor] = field(default_factory=list)  # outgrown copies, freed after the last program


@dataclass
class CatalogTables:
    """What the programs of one catalog share, filled as they are rewritten one after another."""

    # hoisted constants by (shape, stride, dtype, device, digest): one buffer per value
    constants: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    # workspace copies by the stock workspace's (storage, offset, shape, dtype)
    workspaces: dict[tuple, SharedWorkspace] = field(default_factory=dict)
    # SHA-256 of the weights hoisted cones read, by (pointer, shape, stride, dtype, version)
    digests: dict[tuple, str] = field(default_factory=dict)
    # autocast blocks retraced by ``inline_autocast``, by (subgraph code, autocast arguments, operands):
    # every lane rewrites the same programs, and the retrace is the slow part of the pipeline
    retraced: dict[tuple, GraphModule] = field(default_factory=dict)
    # undo-journal buffers a loaded artifact allocates, by (program, stored id): one per lane
    journals: dict[tuple, torch.Tensor] = field(default_factory=dict)


def rebind_shared_workspaces(gm: GraphModule, table: dict[tuple, SharedWorkspace]) -> None:
    """Point every module of ``gm`` that holds an outgrown workspace copy at the final (union) copy.

    Programs built before a later class grew the box still reference the smaller copy; this runs
    once all programs exist, before anything is captured.
    """
    final = {id(old): e.tensor for e in table.values() for old in e.stale}
    if not final:
        return
    for mod in gm.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and id(buf) in final:
                mod._buffers[name] = final[id(buf)]
        for name, val in list(vars(mod).items()):
            if isinstance(val, torch.Tensor) and id(val) in final:
                setattr(mod, name, final[id(val)])


def release_stale_workspaces(table: dict[tuple, SharedWorkspace]) -> int:
    """Free the outgrown copies once every program points at the union copy; returns the bytes freed.

    The passes' intermediate modules (the graph before partitioning) can outlive the pipeline and
    still name an outgrown copy; the copies are ours (clones), so their storage is released outright.
    """
    freed = 0
    for e in table.values():
        for old in e.stale:
            freed += old.untyped_storage().nbytes()
            old.untyped_storage().resize_(0)
        e.stale.clear()
        e.stock = None  # the stock workspace belongs to the user's module, not to the program
    return freed
