"""The artifact's errors, and how a malformed payload's errors become them (naming the file and the place)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["ArtifactError", "ArtifactMismatch", "malformed", "where"]


class ArtifactError(RuntimeError):
    """An artifact that cannot be written (a program holding something it cannot store) or read
    (not an artifact, truncated, corrupted: a digest differs)."""


class ArtifactMismatch(ArtifactError):
    """An intact artifact built for another torch, device, kernel settings or contract: its bytes are
    the optimized program's only there."""


@contextlib.contextmanager
def malformed(path: Any) -> Iterator[None]:
    """What a malformed payload raises while it is decoded (a missing key, a mistyped or misshapen
    entry), as :class:`ArtifactError` naming the file; FileNotFoundError and the artifact's own
    errors (ArtifactMismatch included) keep their kind."""
    try:
        yield
    except ArtifactError as e:
        if str(e).startswith("cadence_fx.load"):
            raise
        raise type(e)(f"cadence_fx.load: {path}: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError) as e:
        raise ArtifactError(f"cadence_fx.load: {path}: malformed artifact ({type(e).__name__}: {e})") from e


def where(index: int, path: str) -> str:
    """How a message names module ``path`` of stored program ``index``."""
    return f"program {index}, module {path or '<root>'!r}"
