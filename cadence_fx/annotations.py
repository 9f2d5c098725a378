"""What the passes write into the graphs they hand on, and what the runtime reads back.

The passes end at an annotated ``GraphModule``: contract-owned tensors are attributes under the
prefixes below, and every wrapped partition's ``call_module`` node carries a :class:`ReplaySpec` in
its ``meta``. Nothing else passes between rewriting and running; this module is the one place
those names are defined.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

# attribute prefixes on the rewritten GraphModule
REGION_PREFIX = "_cf_region_"        # a contract-owned region buffer (state)
WORKSPACE_PREFIX = "_cf_workspace_"  # a demand-sized copy of a program-owned workspace (state)
CONST_PREFIX = "_cf_const_"          # a hoisted constant (computed once at optimize time)
INLINED_PREFIX = "_cf_inlined_"      # a tensor an inlined subgraph referenced
AUDITOR_ATTR = "_cf_auditor"         # verify mode's auditor object
STATE_PREFIXES = (REGION_PREFIX, WORKSPACE_PREFIX)
OWNED_PREFIX = "_cf_"                # anything the passes registered

# node.meta keys
WRAPPED = "cadence_wrapped"  # on a partition's call_module node: the wrapped invocation it runs
SEGMENT = "cadence_segment"  # ... and which segment of it (Contract.split_at), 0 when unsplit
REPLAY = "cadence_replay"    # ... and its ReplaySpec, once mark_replay has analysed it
RANDOM = "cadence_random"    # on a partition's call node or a root-level op: it draws from a generator


@dataclass(frozen=True)
class ReplaySpec:
    """How one wrapped partition may be replayed, derived from its graph by ``mark_replay``.

    Attributes:
        name: the wrapped invocation (``segment`` appended after ``#`` when split).
        aliased: argument positions that are fixed-address tensors (weights, constants, region
            buffers, workspaces, and views of them): used in place, checked by pointer, never staged.
        readonly: the aliased positions the partition never writes and that are not state.
        written: every argument position the partition writes through any view; ``None`` when
            the graph holds something whose writes its schema cannot vouch for.
    """

    name: str
    aliased: tuple[int, ...]
    readonly: tuple[int, ...]
    written: tuple[int, ...] | None


def replay_spec(node: Node) -> ReplaySpec | None:
    """The spec ``mark_replay`` wrote on a partition's call node, if any."""
    spec = node.meta.get(REPLAY)
    return spec if isinstance(spec, ReplaySpec) else None


def is_state_attr(target: object) -> bool:
    """True for the attribute of a region buffer or a workspace copy (state the program owns)."""
    return isinstance(target, str) and target.startswith(STATE_PREFIXES)


def is_region_attr(target: object) -> bool:
    return isinstance(target, str) and target.startswith(REGION_PREFIX)
