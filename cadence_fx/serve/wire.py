"""How host tensors cross Ray's process boundaries: as numpy arrays, not through torch's pickle.

torch pickles a tensor by writing it with ``torch.save`` into a byte string (a zip archive per
tensor): 250 us for one 256-byte chunk input on this project's CPU, against 18 us for the same bytes as
a numpy array, which Ray also passes out of band (no copy into the pickle stream; zero-copy reads from
the object store). A chunk crosses four hops (client, controller, worker and back), each with its
inputs or outputs, so torch's path alone cost more than the 2 ms routing target.

:func:`install` registers a serializer for ``torch.Tensor`` in the calling process (Ray's
``register_serializer`` is per process): workers and the controller install it when they start; a
client may (``benchmarks/serve.py`` does); a process that does not still reads what the others send
(the deserializer is a plain importable function). Host tensors travel as their contiguous bytes with
their torch dtype (a dtype numpy lacks, bfloat16, travels as an integer view of its bytes); a device
tensor, or one of a dtype with no same-size integer, goes through torch's own pickle, as before.
Values and shapes are kept, strides are not (a contiguous copy arrives), nor autograd history (the
step never records any). An array Ray hands out read-only (read zero-copy from the object store) is
copied once, so the tensor is the receiver's to write.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import ray
import torch

__all__ = ["install", "tensor_from_wire", "tensor_to_wire"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_installed: set[str] = set()  # the Ray sessions (node, job) this process registered the serializer in
_lock = threading.Lock()


def tensor_to_wire(t: torch.Tensor) -> tuple[Any, ...]:
    """``("np", array, dtype name)`` for a host tensor; ``("pt", torch.save bytes)`` otherwise."""
    if t.device.type == "cpu" and not t.is_sparse and not t.is_quantized:
        flat = t.detach().resolve_conj().resolve_neg().contiguous()
        name = str(flat.dtype).removeprefix("torch.")
        try:
            return ("np", flat.numpy(), name)
        except TypeError:  # bfloat16, float8: no numpy dtype; their bytes as an integer of their size
            as_int = _INT_OF_SIZE.get(flat.element_size())
            if as_int is not None:
                return ("np", flat.view(as_int).numpy(), name)
    buf = io.BytesIO()
    torch.save(t, buf)
    return ("pt", buf.getvalue())


def tensor_from_wire(packed: tuple[Any, ...]) -> torch.Tensor:
    """The tensor :func:`tensor_to_wire` packed."""
    if packed[0] == "pt":
        return torch.load(io.BytesIO(packed[1]), weights_only=True)
    _, arr, name = packed
    if not arr.flags.writeable:
        arr = np.array(arr)
    t = torch.from_numpy(arr)
    dtype = getattr(torch, name)
    return t if t.dtype == dtype else t.view(dtype)


def install() -> None:
    """Register the numpy path for ``torch.Tensor`` with Ray in this process (once; Ray must be
    initialized, as it is in every actor)."""
    with _lock:
        if not ray.is_initialized():
            return
        ctx = ray.get_runtime_context()
        session = f"{ctx.get_node_id()}/{ctx.get_job_id()}"  # a fresh ray.init starts its job ids over
        if session in _installed:
            return
        ray.util.register_serializer(torch.Tensor, serializer=tensor_to_wire, deserializer=tensor_from_wire)
        _installed.add(session)
