"""The artifact file: written atomically, read (optionally pinned by its SHA-256), its manifest parsed and
checked before anything is decoded or allocated, and the digests of the tensors it stores.

What loading may allocate is bounded here (``ALLOCATION_FLOOR``), from the stored tensors' own bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import torch

from cadence_fx.artifact.exceptions import ArtifactError, ArtifactMismatch
from cadence_fx.artifact.graph_codec import check_modules
from cadence_fx.artifact.values import decode, decode_plan, parse_dtype, parse_shape
from cadence_fx.determinism import sha256_tensors

__all__ = ["ALLOCATION_FLOOR", "FORMAT", "VERSION", "check_digests", "check_manifest", "parse_manifest",
           "read_payload", "storage_bytes", "tensor_digests", "tensor_names",
           "write_atomically"]

FORMAT = "cadence_fx.artifact"
VERSION = 1
# What loading may allocate from sizes the file declares (a zero workspace is stored as a shape only,
# region buffers as the plan's shapes, a stored view may span more than its storage): each stored
# tensor's view (digesting it copies it), each input warmup makes and each session's region buffer,
# and per lane the region buffers and workspaces together, take at most the bytes of the stored
# tensors' storages (which torch.load has read, so the file carried them) or this allowance, whichever
# is larger (for programs whose state outweighs their weights). A bound from the plan's own shapes
# would bound nothing: the plan is in the same file. Token2Wav at reduced sizes: 19 MB of state a
# lane against 327 MB of tensors.
ALLOCATION_FLOOR = 1 << 30


def write_atomically(path: Path, payload: dict[str, Any]) -> str:
    """``torch.save`` to a fresh file beside ``path``, renamed over it; the file's SHA-256.

    ``mkstemp`` creates the file exclusively (O_EXCL: no existing file or link is opened) under an
    unpredictable name, and ``os.replace`` swaps the name atomically: a crash mid-write never leaves
    a truncated artifact under the real name, and a link at ``path`` is replaced, not followed.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w+b") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # the mode a plain open() would have given it
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            digest, _n = _sha256_file(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return digest


def _umask() -> int:
    mask = os.umask(0o077)  # the restrictive one, should another thread create a file meanwhile
    os.umask(mask)
    return mask


def _sha256_file(f: Any, into: memoryview | None = None) -> tuple[str, int]:
    """SHA-256 of the rest of the open file ``f``, read in 16 MiB pieces, and how many bytes that
    was. With ``into`` the bytes are kept there, as far as it reaches (no further byte is hashed)."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(1 << 24)) if into is None else into
    n = 0
    while True:
        piece = buf if into is None else buf[n:n + (1 << 24)]
        got = f.readinto(piece) if len(piece) else 0
        if not got:
            return h.hexdigest(), n
        h.update(piece[:got])
        n += got


def read_payload(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """The payload ``torch.load(weights_only=True)`` reads; with ``sha256``, from the bytes that were
    hashed (the file is read once, into memory: it cannot change between the check and the parse)."""
    source: Any = path
    if sha256 is not None:
        if not (isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256.lower())):
            raise ValueError(f"cadence_fx.load: sha256 must be 64 hex digits (as cf.save returned it), got {sha256!r}")
        sha256 = sha256.lower()
        with open(path, "rb") as f:
            data = memoryview(bytearray(os.fstat(f.fileno()).st_size))
            got, n = _sha256_file(f, data)
        if got != sha256:
            raise ArtifactError(f"cadence_fx.load: {path} has SHA-256 {got}, not the pinned {sha256}: not the "
                                f"artifact that was given")
        source = _BytesReader(data[:n])
    try:
        # read into memory of its own (not mmap): a later write to the file must not reach a running program
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a damaged zip
        raise ArtifactError(f"cadence_fx.load: {path} is not a readable cadence_fx artifact "
                            f"({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ArtifactError(f"cadence_fx.load: {path} is not a cadence_fx artifact (written by cadence_fx.save)")
    return payload


class _BytesReader(io.RawIOBase):
    """A read-only file over bytes in memory, not copied (``io.BytesIO`` copies a bytearray)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self._pos, len(self._data))[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._data) - self._pos))
        b[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


def parse_manifest(payload: Mapping[str, Any]) -> dict[str, Any]:
    text = payload.get("manifest")
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != payload.get("manifest_sha256"):
        raise ArtifactError("cadence_fx.load: the artifact's manifest does not match its SHA-256 (corrupted)")
    try:  # NaN and infinities are tagged by the writer (allow_nan=False): a bare one is not an artifact's
        manifest = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"the manifest is not an artifact's JSON ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError("the manifest is not a JSON object")
    if manifest.get("version") != VERSION:
        raise ArtifactMismatch(f"cadence_fx.load: artifact format version {manifest.get('version')}, this "
                               f"cadence_fx reads version {VERSION}; save it again with this version")
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"bare {name}")


def check_manifest(manifest: Mapping[str, Any], tensors: Any, workspaces: Any) -> None:
    """What the payload declares, checked before anything is decoded or allocated: the tensor
    tables (dense tensors, as many as the manifest lists), the sizes loading allocates (bounded by
    the stored tensors, ``ALLOCATION_FLOOR``), and every program's module tree and references."""
    if not isinstance(tensors, list) or not isinstance(workspaces, list) or len(tensors) != len(manifest["tensors"]) \
            or len(workspaces) != len(manifest["workspaces"]):
        raise ArtifactError("the tensor table does not match the manifest (corrupted)")
    for i, t in enumerate(tensors):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise ArtifactError(f"tensor {i} is a {type(t).__name__}, not a dense tensor")
    budget = max(ALLOCATION_FLOOR, storage_bytes(tensors))

    def bounded(nbytes: int, what: str) -> None:
        if nbytes > budget:
            raise ArtifactError(f"{what} takes {nbytes} bytes, more than loading this artifact may allocate "
                                f"({budget}: the larger of its tensors' {storage_bytes(tensors)} bytes and "
                                f"{ALLOCATION_FLOOR})")

    for i, t in enumerate(tensors):  # a view may span more than its storage (digesting copies it)
        bounded(t.numel() * t.element_size(), f"tensor {i}")
    state = 0  # what each lane allocates: region buffers and workspaces
    for j, (w, t) in enumerate(zip(manifest["workspaces"], workspaces)):
        shape, dtype = parse_shape(w["shape"], f"workspace {j}"), parse_dtype(w["dtype"])
        if t is not None and (type(t) is not torch.Tensor or tuple(t.shape) != shape or t.dtype != dtype):
            raise ArtifactError(f"workspace {j}: the stored tensor is not the {list(shape)} {dtype} the manifest "
                                f"declares")
        state += math.prod(shape) * dtype.itemsize
    programs = manifest["programs"]
    plan = decode_plan(manifest["plan"])
    for rp in plan.regions:
        size = parse_dtype(programs[0]["sites"][rp.name]["dtype"]).itemsize
        state += math.prod(parse_shape(rp.stored_shape, f"region {rp.name!r}")) * size
        bounded(math.prod(parse_shape(rp.session_shape, f"region {rp.name!r}")) * size, f"a session's region {rp.name!r}")
    bounded(state, "a lane's region buffers and workspaces")
    counts = {"tensor": len(tensors), "workspace": len(workspaces)}
    regions = {rp.name for rp in plan.regions}
    for i, p in enumerate(programs):
        for arg in decode(p["key"]):
            if arg[0] == "T":  # an input warmup may make (a zero tensor of that shape)
                if not isinstance(arg[2], torch.dtype):
                    raise ArtifactError(f"program {i}: an input's dtype is {arg[2]!r}")
                bounded(math.prod(parse_shape(arg[1], f"program {i}, input")) * arg[2].itemsize, f"program {i}'s input")
        for name, site in p["sites"].items():
            parse_shape(site["shape"], f"program {i}, site {name!r}")
            parse_shape(site["out_shape"], f"program {i}, site {name!r}")
        for _name, idx, _digest in p["folded"] or ():
            if idx is not None and not (type(idx) is int and 0 <= idx < len(tensors)):
                raise ArtifactError(f"program {i}: folded weight {_name!r} refers to tensor {idx!r}, not in the table")
        check_modules(p["modules"], i, counts, regions)


def tensor_digests(tensors: list[torch.Tensor]) -> list[str]:
    """SHA-256 of each tensor, on a few threads (hashlib releases the GIL on large buffers)."""
    if len(tensors) < 16:
        return [sha256_tensors(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_tensors, tensors))


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def check_digests(path: Any, tensors: list[torch.Tensor], manifest: Mapping[str, Any],
                   workspaces: list[torch.Tensor | None]) -> None:
    got = tensor_digests(tensors)
    for i, (want, have) in enumerate(zip((t["sha256"] for t in manifest["tensors"]), got)):
        if want != have:
            raise ArtifactError(f"cadence_fx.load: {path}: tensor {i} ({tensor_names(manifest, i)}) does not match "
                                f"its SHA-256 (corrupted or altered artifact)")
    for j, (w, t) in enumerate(zip(manifest["workspaces"], workspaces)):
        if (t is None) != w["zero"] or (t is not None and sha256_tensors(t) != w["sha256"]):
            raise ArtifactError(f"cadence_fx.load: {path}: workspace {j} does not match its SHA-256 (corrupted)")


def tensor_names(manifest: Mapping[str, Any], i: int) -> str:
    names = [f"{m['path'] + '.' if m['path'] else ''}{a[0]}" for p in manifest["programs"] for m in p["modules"]
             for a in m.get("attrs", ()) if a[2] == ["tensor", i]]
    return ", ".join(sorted(set(names))[:3]) or "unreferenced"
