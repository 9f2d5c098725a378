"""An artifact for workers on machines that do not see its path: its bytes through Ray's object store.

A worker is built from a file ``cf.save`` wrote (:class:`~cadence_fx.serve.worker.WorkerConfig`). On one
machine, or with a file system every node mounts, that is a path. Otherwise :func:`share_artifact` puts
the file's bytes in the object store once (owned by the caller), and each worker that is handed the
reference writes them to a file of its own, loads it (the SHA-256 pin checks what it read) and removes
it (:func:`artifact_file`). Apart from the worker because it is transport, not serving.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import ray

__all__ = ["artifact_file", "share_artifact"]


def share_artifact(path: str | os.PathLike[str]) -> Any:
    """The artifact's bytes in Ray's object store (owned by the caller), for workers on machines that do
    not see ``path``: ``WorkerConfig(share_artifact(path), sha256=...)``. Each worker writes them to a
    file of its own, loads it (the SHA-256 pin checks what it read) and removes it."""
    return ray.put(Path(path).read_bytes())


@contextmanager
def artifact_file(artifact: Any) -> Iterator[str]:
    """A path to load ``artifact`` from: the path itself, or a temporary file of the shared bytes
    (removed on exit)."""
    if isinstance(artifact, (str, os.PathLike)):
        yield os.fspath(artifact)
        return
    data = ray.get(artifact)
    fd, path = tempfile.mkstemp(suffix=".cfx", prefix="cadence-artifact-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        yield path
    finally:
        os.unlink(path)
