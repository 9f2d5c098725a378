"""What the replay engine reports: counters by reason, and one record per captured (or refused) class."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["ClassReport", "ReplayCounters", "Signature"]

Signature = tuple  # the exact input signature a class is keyed by (shapes, strides, dtypes, scalars, settings)


@dataclass
class ReplayCounters:
    """Per-engine call accounting; every eager call has exactly one rejection reason."""

    replays: int = 0
    eager: int = 0
    rejections: Counter[str] = field(default_factory=Counter)
    invalidations: int = 0
    captures: int = 0


@dataclass
class ClassReport:
    """Outcome of ``capture`` for one signature class."""

    key: Signature | None
    admitted: bool
    reason: str | None = None          # rejection reason when not admitted
    effect: str | None = None          # "pure" | "device_rng"
    capture_seconds: float = 0.0       # probe + warm-up + capture
    # host seconds by phase: "probe" (the eager run that classifies effects, and its rewind),
    # "stage_and_warmup" (static buffers loaded, warm-up runs queued), "capture" (the backend's capture,
    # which waits for the device first: queued warm-up work lands here)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    graph_bytes: int = 0               # memory_reserved delta across capture (see module doc)
    staging_bytes: int = 0             # static input buffers this capture allocated (outside the graph pool;
                                       # 0 when they fit in the engine's shared StagingArena)
    staged_bytes: int = 0              # what each replay copies into static input buffers
    aliased_ptrs: dict[int, int] = field(default_factory=dict)
    copy_back: tuple[int, ...] = ()    # staged arguments fn mutates, written back after replay
    snapshotted: frozenset[int] = frozenset()  # storages of the arguments capture snapshotted to rewind
    error: str | None = None
