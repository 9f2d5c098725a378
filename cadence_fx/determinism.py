"""Determinism envelope: pin the kernel settings exactness is judged under, and prove
that a baseline reproduces itself under them before comparing anything with it.

The stock GPU baseline is not reproducible run to run as shipped; with cuDNN pinned
(``deterministic=True``, ``benchmark=False``) and cuDNN's attention backend of
``scaled_dot_product_attention`` turned off, it is. The attention: on an H200 the default SDPA
dispatch picks cuDNN attention for a bf16 query against a masked KV ring, and moshi's stock eager
stream run twice, each in its own process, parted from the 65th frame on (one attention call repeated
within one process agrees with itself); with cuDNN attention off, SDPA dispatches to the
memory-efficient kernel. ``torch.use_deterministic_algorithms``
stays off by default: it is not needed for that, it raises on ops that lack a
deterministic variant, wants ``CUBLAS_WORKSPACE_CONFIG``, and fills every new tensor
(extra kernels inside captured graphs) unless
``torch.utils.deterministic.fill_uninitialized_memory`` is turned off. Reproducibility
is therefore proved by ``check_reproducible`` rather than assumed from a flag.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch

from cadence_fx import kernel_settings

__all__ = ["NotReproducibleError", "bits_equal", "check_reproducible", "envelope", "pin_envelope", "sha256_tensors"]


class NotReproducibleError(RuntimeError):
    """Two runs of the same program under the same envelope produced different bytes."""

    def __init__(self, run_index: int, digests: list[str]) -> None:
        self.run_index = run_index
        self.digests = digests
        super().__init__(f"run {run_index} differs from run 0: sha256 {digests[run_index]} != {digests[0]}")


def pin_envelope(*, deterministic_algorithms: bool = False, cudnn_attention: bool = False) -> dict[str, object]:
    """Pin cuDNN to deterministic, non-benchmarked kernels, turn cuDNN's SDPA backend off (unless
    ``cudnn_attention``) and return the settings applied.

    Only settings: no device or library is touched, so a restarted server can pin the envelope before
    ``cadence_fx.load`` starts the device on a thread of its own. :func:`describe_envelope` adds the
    library versions and the device (which loads cuDNN and starts the device).
    """
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
    # the call imports more of torch (a second on a small CPU): made only when the state changes
    if torch.are_deterministic_algorithms_enabled() != deterministic_algorithms \
            or (deterministic_algorithms and torch.is_deterministic_algorithms_warn_only_enabled()):
        torch.use_deterministic_algorithms(deterministic_algorithms)
    return envelope_settings()


def envelope_settings() -> dict[str, object]:
    """The current envelope: every kernel setting of :mod:`cadence_fx.kernel_settings` (JSON values),
    ``CUBLAS_WORKSPACE_CONFIG`` and the build versions, read without touching a device or library.
    ``sdpa.cudnn_attention`` repeats ``sdpa.cudnn`` under the name results recorded before the table."""
    settings = kernel_settings.snapshot()
    return {**settings,
            "sdpa.cudnn_attention": settings.get("sdpa.cudnn"),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda}


def describe_envelope() -> dict[str, object]:
    """The current envelope settings, the cuDNN version and the device, without changing any (to
    print next to a result; loads cuDNN and starts the device)."""
    return {**envelope_settings(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


@contextmanager
def envelope(*, deterministic_algorithms: bool = False, cudnn_attention: bool = False) -> Iterator[dict[str, object]]:
    """``pin_envelope`` for the duration of a ``with`` block; every kernel setting comes back on exit."""
    previous = kernel_settings.snapshot()
    try:
        yield pin_envelope(deterministic_algorithms=deterministic_algorithms, cudnn_attention=cudnn_attention)
    finally:
        kernel_settings.apply(previous)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor in row-major order, on its device: a view where ``t`` is
    laid out densely, else a copy. ``contiguous()`` alone is not enough: a dimension of size 1 counts as
    contiguous whatever its stride, and a byte view needs the last stride to be 1 (one element taken
    with a step, ``x[::2]`` of two, is such a tensor: ``contiguous().view(torch.uint8)`` raises on it)."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # fresh strides (a clone would keep this "contiguous" one)
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8)


def sha256_tensors(tensors: torch.Tensor | Iterable[torch.Tensor | None]) -> str:
    """SHA-256 of the raw bytes of the tensors, in order (``None`` entries are skipped).

    Bytes are taken in row-major order of the logical tensor, so the digest does not
    depend on strides. Copying to the host synchronizes with the device.
    """
    h = hashlib.sha256()
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        if t is None:
            continue
        if t.numel():
            h.update(_raw_bytes(byte_view(t.detach().cpu())))
    return h.hexdigest()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two same-shaped tensors on one device: NaN payloads and signed zeros count."""
    if a.numel() == 0:
        return True
    return torch.equal(byte_view(a), byte_view(b))


def _raw_bytes(flat: torch.Tensor) -> memoryview | bytes:
    try:
        return flat.numpy().data
    except (ImportError, RuntimeError):  # torch built or installed without numpy
        return bytes(flat.clone().untyped_storage())


def check_reproducible(run: Callable[[], Sequence[torch.Tensor] | torch.Tensor], *, runs: int = 2) -> str:
    """Run ``run`` ``runs`` times; return the common digest or raise ``NotReproducibleError``.

    Each run's outputs are hashed before the next run starts, so programs that reuse
    output buffers (graph replay) are judged on what each run returned.
    """
    if runs < 1:
        raise ValueError("runs must be at least 1")
    digests: list[str] = []
    for i in range(runs):
        digests.append(sha256_tensors(run()))
        if digests[i] != digests[0]:
            raise NotReproducibleError(i, digests)
    return digests[0]
