"""One copy of a module's weights for every worker process on a GPU (CUDA IPC).

Several worker processes share one GPU under MPS because kernels of different processes overlap where
lanes of one process do not; each process then holds its own copy of the weights (a released Moshi LM:
14.7 GB a process), and the copies, not the conversations, fill the GPU first. :func:`publish_weights`
writes where one process's parameters live (CUDA IPC handles); :func:`map_weights` in another process
on the same GPU points its module's parameters at them.

Exactness is checked, not assumed: a parameter is mapped only where the published one has the same
name, shape, stride and dtype **and the same bytes** as the mapping process's own (``torch.equal``
over the bits, on the GPU); anything else is an error naming the parameters, before any parameter is
changed. The publication is JSON (handles as hex), so reading one runs no code from it.

The publishing process must outlive every process that mapped its weights (CUDA IPC memory is the
publisher's allocation), and nobody may write a mapped parameter: the guard on folded weights
(:class:`~cadence_fx.runtime.weights.FoldedWeights`) sees writes of this process only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cadence_fx.determinism import bits_equal

__all__ = ["PublishedWeights", "WeightsNotShared", "map_weights", "publish_weights", "read_publication"]

log = logging.getLogger(__name__)

FORMAT = "cadence_fx.process_weights/1"


class WeightsNotShared(RuntimeError):
    """A publication that cannot be mapped: absent, malformed, another GPU's, or weights that differ."""


@dataclass(frozen=True)
class PublishedWeights:
    """A publication read back: the publisher's pid and GPU, and per parameter its tensor geometry and
    the fields ``UntypedStorage._new_shared_cuda`` takes."""

    pid: int
    device_uuid: str
    entries: dict[str, dict]

    @property
    def nbytes(self) -> int:
        return sum(e["nbytes"] for e in self.entries.values())


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def publish_weights(module: nn.Module, path: str | os.PathLike) -> int:
    """Write where ``module``'s parameters (all on one CUDA device) live to ``path`` (atomically: a
    reader sees the whole file or none); returns the bytes published. Keep ``module`` alive while any
    process uses the mapping."""
    entries: dict[str, dict] = {}
    device = None
    for name, p in module.named_parameters():
        if p.device.type != "cuda":
            raise WeightsNotShared(f"parameter {name!r} is on {p.device}; only CUDA weights can be shared")
        if device is not None and p.device != device:
            raise WeightsNotShared(f"parameters on {device} and {p.device}: publish one device's module")
        device = p.device
        (dev, handle, size_b, offset_b, ref_handle, ref_offset, event_handle,
         event_sync) = p.untyped_storage()._share_cuda_()
        entries[name] = dict(shape=list(p.shape), stride=list(p.stride()), storage_offset=p.storage_offset(),
                             dtype=str(p.dtype).removeprefix("torch."), nbytes=p.numel() * p.element_size(),
                             cuda=[dev, handle.hex(), size_b, offset_b, ref_handle.hex(), ref_offset,
                                   None if event_handle is None else event_handle.hex(), bool(event_sync)])
    if device is None:
        raise WeightsNotShared("the module has no parameters to publish")
    torch.cuda.synchronize(device)  # the bytes are written before anyone maps them
    doc = dict(format=FORMAT, pid=os.getpid(), device_uuid=_uuid(device), entries=entries)
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    pub = PublishedWeights(doc["pid"], doc["device_uuid"], entries)
    log.info("published %d parameters (%.1f MiB) to %s", len(entries), pub.nbytes / 2**20, path)
    return pub.nbytes


def read_publication(path: str | os.PathLike, *, wait_s: float = 0.0) -> PublishedWeights:
    """The publication at ``path``, waiting up to ``wait_s`` for it to appear; :class:`WeightsNotShared`
    when it does not, or when it is not a publication of this format."""
    path = Path(path)
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise WeightsNotShared(f"no weights published at {path} (waited {wait_s:g} s)")
        time.sleep(0.2)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsNotShared(f"{path}: not a weights publication ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise WeightsNotShared(f"{path}: not a {FORMAT} publication")
    entries = doc.get("entries")
    if not isinstance(entries, dict) or not all(_entry_ok(e) for e in entries.values()):
        raise WeightsNotShared(f"{path}: malformed entries")
    return PublishedWeights(int(doc.get("pid", -1)), str(doc.get("device_uuid")), entries)


def _entry_ok(e: object) -> bool:
    if not isinstance(e, dict):
        return False
    try:
        ok = (all(isinstance(x, int) for x in e["shape"] + e["stride"]) and isinstance(e["storage_offset"], int)
              and isinstance(getattr(torch, e["dtype"], None), torch.dtype) and isinstance(e["nbytes"], int)
              and isinstance(e["cuda"], list) and len(e["cuda"]) == 8)
        if ok:
            bytes.fromhex(e["cuda"][1]), bytes.fromhex(e["cuda"][4])
            if e["cuda"][6] is not None:
                bytes.fromhex(e["cuda"][6])
        return ok
    except (KeyError, TypeError, ValueError):
        return False


def _mismatches(module: nn.Module, pub: PublishedWeights) -> list[str]:
    """What keeps ``module``'s parameters from the publication's, geometry only (no handle opened)."""
    own = dict(module.named_parameters())
    out = [f"{n}: not published" for n in own if n not in pub.entries]
    out += [f"{n}: published, not a parameter here" for n in pub.entries if n not in own]
    for n, p in own.items():
        e = pub.entries.get(n)
        if e is None:
            continue
        want = (list(p.shape), list(p.stride()), str(p.dtype).removeprefix("torch."))
        got = (e["shape"], e["stride"], e["dtype"])
        if want != got:
            out.append(f"{n}: shape/stride/dtype {got} published, {want} here")
    return out


def _open(e: dict) -> torch.Tensor:
    dev, handle, size_b, offset_b, ref_handle, ref_offset, event_handle, event_sync = e["cuda"]
    storage = torch.UntypedStorage._new_shared_cuda(
        dev, bytes.fromhex(handle), size_b, offset_b, bytes.fromhex(ref_handle), ref_offset,
        None if event_handle is None else bytes.fromhex(event_handle), event_sync)
    dtype = getattr(torch, e["dtype"])
    return torch.empty(0, dtype=dtype, device=f"cuda:{dev}").set_(
        storage, e["storage_offset"], e["shape"], e["stride"])


def map_weights(module: nn.Module, path: str | os.PathLike, *, wait_s: float = 0.0) -> int:
    """Point ``module``'s parameters at the ones published at ``path`` by another process on the same
    GPU, where they are bitwise equal to ``module``'s own; returns the bytes this process no longer
    holds (after ``torch.cuda.empty_cache``). Raises :class:`WeightsNotShared`, with every parameter
    unchanged, when the publication is another GPU's, its names or geometry differ, or any bytes differ."""
    pub = read_publication(path, wait_s=wait_s)
    params = dict(module.named_parameters())
    if not params:
        raise WeightsNotShared("the module has no parameters to map")
    device = next(iter(params.values())).device
    if device.type != "cuda" or pub.device_uuid != _uuid(device):
        raise WeightsNotShared(f"{path}: published on GPU {pub.device_uuid}, this module is on {device}")
    bad = _mismatches(module, pub)
    if bad:
        raise WeightsNotShared(f"{path}: {len(bad)} parameter(s) do not match: " + "; ".join(bad[:8]))
    opened = {n: _open(pub.entries[n]) for n in params}
    differ = [n for n, p in params.items() if not bits_equal(p.detach(), opened[n])]
    if differ:
        raise WeightsNotShared(f"{path}: {len(differ)} parameter(s) hold other bytes than this process's "
                               f"own ({', '.join(differ[:8])}); nothing was mapped")
    freed = 0
    with torch.no_grad():
        for n, p in params.items():
            if p.untyped_storage().data_ptr() != opened[n].untyped_storage().data_ptr():
                freed += p.numel() * p.element_size()
            p.data = opened[n]
    torch.cuda.empty_cache()
    log.info("mapped %d parameters (%.1f MiB) published by pid %d", len(params), freed / 2**20, pub.pid)
    return freed
