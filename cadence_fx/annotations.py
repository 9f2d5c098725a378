"""What the passes write into the graphs they hand on, what they report, and what the runtime reads back.

The passes end at an annotated ``GraphModule``: contract-owned tensors are attributes under the
prefixes below, and every wrapped partition's ``call_module`` node carries a :class:`ReplaySpec` in
its ``meta``. Next to the graphs they report, per program, the state patterns they recognised but
could not prove exact (:class:`Finding`, one of :data:`FINDING_KINDS`). Nothing else passes between
rewriting and running; this module is the one place those names are defined: every attribute prefix,
node meta key and finding kind.

State or constant is told by attribute name: a tensor the passes register is attached under the
prefix of what it is, by ``analysis.graph_io.register_tensor``, and :func:`is_state_attr` reads the
name back. The name is the one thing that goes wherever the tensor's attribute goes: into the
``get_attr`` nodes ``split_module`` makes anew, into a further lane's copy of the program
(``runtime.clone``) and into the artifact, which stores attributes by name. A node meta key stays
on the one node that carries it, and a registry held by the passes ends with the ``optimize`` call
(a loaded program, whose lanes still tell the passes' tensors from the module's, never had one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch.fx import Node

# attribute prefixes on the rewritten GraphModule
REGION_PREFIX = "_cf_region_"        # a contract-owned region buffer (state)
WORKSPACE_PREFIX = "_cf_workspace_"  # a demand-sized copy of a program-owned workspace (state)
CONST_PREFIX = "_cf_const_"          # a hoisted constant (computed once at optimize time)
INLINED_PREFIX = "_cf_inlined_"      # a tensor an inlined subgraph referenced
RETURNED_PREFIX = "_cf_returned_"    # a module tensor the step returns as it is, re-attached after partitioning
JOURNAL_PREFIX = "_cf_journal_"     # the undo journal: bytes a call's writes overwrite (passes.journal_writes)
AUDITOR_ATTR = "_cf_auditor"         # verify mode's auditor object
STATE_PREFIXES = (REGION_PREFIX, WORKSPACE_PREFIX)
OWNED_PREFIX = "_cf_"                # anything the passes registered
# on a partition: an outer tensor no node writes, bound as the partition's own attribute (the same
# tensor under ``BOUND_PREFIX`` + its outer path with dots as ``__``: ``bound_name``). Not under
# OWNED_PREFIX: it is the stock module's tensor (or a hoisted constant), never written, under a
# partition-local name.
BOUND_PREFIX = "bound__"

# node.meta keys; those under META_PREFIX are the passes' own, and the artifact stores every one a
# graph it saves still carries (``PARTITION`` never reaches one)
META_PREFIX = "cadence_"
WRAPPED = "cadence_wrapped"  # on a partition's call_module node: the wrapped invocation it runs
SEGMENT = "cadence_segment"  # ... and which segment of it (Contract.split_at), 0 when unsplit
REPLAY = "cadence_replay"    # ... and its ReplaySpec, once mark_replay has analysed it
RANDOM = "cadence_random"    # on a partition's call node or a root-level op: it draws from a generator
# the partition pass's own: on each node it schedules, the index of the partition it goes to
# (split_module copies a node's meta to the node it makes of it); gone from every graph it hands on
PARTITION = "cadence_partition"

# finding kinds (Finding.pattern): a state pattern a pass recognised, left as the stock program has it
RING_UPDATE_KEPT = "ring_update_kept"              # ring_in_place: the functional whole-region update stays
HISTORY_WORKSPACE_KEPT = "history_workspace_kept"  # envelope_state: the history stays in a workspace of its own
CONTIGUOUS_INPUT_COPY = "contiguous_input_copy"    # envelope_state: a stride-bound reader gets a contiguous copy
WORKSPACE_STOCK_SIZE = "workspace_stock_size"      # shrink_workspace: the workspace stays at its stock size
CAT_NOT_APPEND = "cat_not_append"                  # carry_writeback: a cat of the region that is no append
STATE_REPLACED = "state_replaced"                  # retention_in_place: the new state does not read the old one
STATE_COPIED = "state_copied"                      # retention_in_place: the new state is no slices of one tensor
TRAFFIC_ABOVE_STOCK = "traffic_above_stock"        # retention_in_place: the rewrite moves more state bytes than stock
# how each reads in a log or a benchmark record: ``subject`` (the region, or the workspace attribute) and ``reason``
_FINDING_TEXT = {
    RING_UPDATE_KEPT: "region {subject!r}: {reason}; the functional update is left stock (whole region rebuilt "
                      "and copied)",
    HISTORY_WORKSPACE_KEPT: "region {subject!r}: history workspace kept ({reason})",
    CONTIGUOUS_INPUT_COPY: "region {subject!r}: {reason}: it reads a contiguous copy of the envelope-layout state",
    WORKSPACE_STOCK_SIZE: "workspace {subject!r} kept at its stock size: {reason}",
    CAT_NOT_APPEND: "region {subject!r}: {reason}; no in-place append, the outgoing state is copied into its buffer",
    STATE_REPLACED: "region {subject!r}: {reason}; the outgoing state is copied into its buffer",
    STATE_COPIED: "region {subject!r}: {reason}; the outgoing state is copied into its buffer whole",
    TRAFFIC_ABOVE_STOCK: "region {subject!r}: {reason}",
}
FINDING_KINDS = frozenset(_FINDING_TEXT)
_WORKSPACE_KINDS = frozenset({WORKSPACE_STOCK_SIZE})  # the rest are about a region


@dataclass(frozen=True)
class Finding:
    """A state pattern a pass recognised but could not prove exact, left as the stock program has it
    (``ProgramFacts.left_stock``). ``str()`` is the sentence a log or a benchmark record shows.

    Attributes:
        pattern: what was recognised and kept, one of :data:`FINDING_KINDS`.
        subject: the region's name; for ``WORKSPACE_STOCK_SIZE``, the workspace's attribute.
        reason: why it could not be proved, naming the nodes (prose, for people).
        cls: the program's catalog class: ``(region, extent)`` per region, in the contract's order.
    """

    pattern: str
    subject: str
    reason: str
    cls: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.pattern not in FINDING_KINDS:
            raise ValueError(f"unknown finding kind {self.pattern!r} (one of {', '.join(sorted(FINDING_KINDS))})")

    @property
    def region(self) -> str | None:
        """The region the finding is about; None for a workspace's."""
        return None if self.pattern in _WORKSPACE_KINDS else self.subject

    def __str__(self) -> str:
        return _FINDING_TEXT[self.pattern].format(subject=self.subject, reason=self.reason)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (str, and a dict of str to int): what a codec stores."""
        return {"pattern": self.pattern, "subject": self.subject, "reason": self.reason, "cls": dict(self.cls)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Finding":
        """The finding :meth:`to_dict` gave; ``ValueError`` for anything else."""
        try:
            pattern, subject, reason, klass = d["pattern"], d["subject"], d["reason"], d["cls"]
        except (KeyError, TypeError):
            raise ValueError(f"not a stored finding: {d!r}") from None
        if not all(isinstance(x, str) for x in (pattern, subject, reason)) or not isinstance(klass, Mapping) \
                or not all(isinstance(k, str) and type(v) is int for k, v in klass.items()):
            raise ValueError(f"not a stored finding: {d!r}")
        return cls(pattern, subject, reason, tuple(klass.items()))


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
    """True for the attribute of a region buffer."""
    return isinstance(target, str) and target.startswith(REGION_PREFIX)


def is_journal_attr(target: object) -> bool:
    """True for a journal buffer (written every call, so each lane needs its own copy)."""
    return isinstance(target, str) and target.rsplit(".", 1)[-1].startswith(JOURNAL_PREFIX)


def is_owned_attr(target: object) -> bool:
    """True for any attribute the passes registered (a region buffer, workspace copy, constant, ...)."""
    return isinstance(target, str) and target.startswith(OWNED_PREFIX)


def bound_name(target: str) -> str:
    """The name a partition binds the outer attribute ``target`` under (``bind_constants``)."""
    return BOUND_PREFIX + target.replace(".", "__")
