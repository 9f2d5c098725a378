"""The per-call guard on the weights hoisted constants were computed from.

``hoist_constants`` computes values from weights once (weight norm, a DiT's adaLN projections); a
weight edited in place afterwards would leave those constants stale. :class:`FoldedWeights` keeps
each source's version counter (checked every call, a few µs) and its SHA-256 (checked on demand).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cadence_fx.determinism import sha256_tensors

__all__ = ["FoldedWeights", "WeightsChanged"]


class WeightsChanged(RuntimeError):
    """A weight folded at optimize time was changed in place afterwards."""


@dataclass
class FoldedWeights:
    """The weights and constants one program's hoisted cones read, with their version counters and
    the SHA-256 of their bytes when they were read."""

    sources: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Raise :class:`WeightsChanged` when a source was written since it was folded (a few µs a call)."""
        for name, t, version in self.sources:
            if t._version != version:
                raise WeightsChanged(
                    f"weight {name!r} changed in place after cadence_fx.optimize computed constants from "
                    f"it once; optimize again with the new weights")

    def verify(self) -> None:
        """Raise :class:`WeightsChanged` when a source's bytes differ from when it was folded.

        A full read of every source: it also catches edits that bypass the version counter
        (``w.data.mul_(2)``), which :meth:`check` cannot see.
        """
        for name, t, _version in self.sources:
            if name in self.digests and sha256_tensors(t) != self.digests[name]:
                raise WeightsChanged(
                    f"weight {name!r} differs from its bytes when cadence_fx.optimize computed constants from it "
                    f"(an edit through .data or another alias); optimize again with the new weights")
