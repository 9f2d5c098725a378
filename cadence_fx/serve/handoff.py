"""A conversation handed between two workers on the same GPU without leaving it (CUDA IPC).

Through the object store a move costs the state's bytes twice over PCIe and twice through host
memory (device to host, the store, host to device). Two workers that share a GPU (one host, one
device: two processes of 0.5 GPU each, or a worker and its replacement during a deploy) can do
better: the source packs the conversation into one device buffer (:mod:`cadence_fx.serve.packing`)
and hands the target a CUDA IPC handle of it (PyTorch's ``reduce_tensor``: the allocation's handle,
an inter-process event the target waits on before reading, and a reference count the source's
allocator honours); the target maps the buffer and copies each region into its own session's
buffers, device to device, and lets go of the mapping before it answers. The source keeps the
buffer until the move is closed or undone. A source that dies before the target has copied frees
the buffer under the mapping, so the controller pings the source after the import and distrusts a
copy whose source is gone (the conversation then resumes from its checkpoint).

Only for two processes of one host on one physical device: :func:`device_identity` names the device
(node and GPU UUID) and the controller takes this path only where both ends name the same one; any
failure to map (:class:`HandoffUnavailable`) sends the move through the object store instead, counted.
The bytes are the same either way: the regions are copied, never reinterpreted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from cadence_fx.runtime.rng import RngStates
from cadence_fx.runtime.sessions import Snapshot
from cadence_fx.serve.packing import PackLayout, unpack

__all__ = ["DeviceHandoff", "HandoffUnavailable", "device_identity", "share"]


class HandoffUnavailable(RuntimeError):
    """The target cannot map the source's buffer (another device or host, or IPC refused): move the
    conversation through the object store instead."""


def device_identity(device: torch.device, node_id: str | None) -> str | None:
    """``node/GPU-UUID`` of a CUDA device (what two workers must share for a handoff), else ``None``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"{node_id}/{uuid}" if uuid is not None else None


@dataclass(frozen=True)
class DeviceHandoff:
    """A packed conversation left on the source's GPU: the IPC arguments to map it, its layout, and
    what travels on the host with it (random streams, stream position)."""

    conv_id: str
    identity: str
    layout: PackLayout
    ipc: tuple[Any, ...]  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
    rng_cpu: torch.Tensor
    rng_cuda: tuple[torch.Tensor, ...] | None
    next_seq: int
    seed: int | None
    meta: Mapping[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of the region tensors (what the move copies)."""
        return self.layout.region_bytes()

    def open(self, identity: str | None) -> tuple[Snapshot, Any]:
        """The snapshot to restore, its regions views of the mapped buffer, and the mapping (drop it
        once the restore's copies are done: the source frees the buffer only after). Raises
        :class:`HandoffUnavailable` where this process is on another device or cannot map it."""
        if identity is None or identity != self.identity:
            raise HandoffUnavailable(f"conversation {self.conv_id!r} was handed off on {self.identity}; this worker "
                                     f"is on {identity}")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            flat = rebuild_cuda_tensor(*self.ipc)
        except RuntimeError as e:  # the driver refused to map it (another process's context, a limit)
            raise HandoffUnavailable(f"conversation {self.conv_id!r}: mapping the source's buffer failed: {e}") from e
        cuda = list(self.rng_cuda) if self.rng_cuda is not None else None
        return Snapshot(unpack(flat, self.layout), RngStates(self.rng_cpu.clone(), cuda)), flat


def share(conv_id: str, flat: torch.Tensor, layout: PackLayout, identity: str, rng: RngStates, *, next_seq: int,
          seed: int | None, meta: Mapping[str, float] | None = None) -> DeviceHandoff:
    """The handoff of packed buffer ``flat`` (the caller keeps ``flat`` alive until the move is done)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(flat)
    cuda = tuple(t.cpu() for t in rng.cuda) if rng.cuda is not None else None
    return DeviceHandoff(conv_id, identity, layout, tuple(args), rng.cpu.clone(), cuda, next_seq, seed, dict(meta or {}))
