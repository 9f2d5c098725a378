"""What crosses a process boundary about one conversation: its state, a chunk's result, and its errors.

A conversation's state lives in one worker (a :class:`~cadence_fx.runtime.sessions.Session` of that
worker's program). To move it (a migration, a checkpoint, a resume after a failure) it travels as a
:class:`ConversationState`: every region's tensor on the host, the random streams, and the stream
position (the next chunk's sequence number). Host tensors because Ray's object store moves bytes
between processes and machines, and a device tensor pickled in one process means nothing in another;
the random streams because a step that draws (HiFT's sine source) continues the same stream only if
they travel with the state. Restored through ``Session.restore`` on another worker, the next call
computes exactly what the unmoved session would have computed.

Sequence numbers are the transport's, not the model's: chunk ``seq`` of a conversation is applied
once, in order. A chunk sent twice (a retry after a lost reply) or one that skips a chunk (a lost
request) is refused with :class:`SequenceError` rather than silently changing the stream. A rewind to
a turn boundary (``restore``) puts the numbering back to the snapshot's, as the front end's protocol
has it: the chunks after the snapshot are taken again.

A conversation's placement (:class:`Placement`: its worker's name and handle, and an epoch) is what a
router in the caller's process (:mod:`cadence_fx.serve.router`) caches to send chunks straight to the
worker. Every change of worker (a move, a resume after a failure) opens a new epoch, and a worker
refuses a chunk sent under an old one, or one of a conversation frozen for a move or moved away, with
:class:`Fenced`: nothing was applied, and the router asks the controller where the conversation is.

The errors are plain exceptions with one message argument, so Ray can pickle them and re-raise them
in the caller as themselves (``except SequenceError`` works across actors).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from cadence_fx.runtime.rng import RngStates
from cadence_fx.runtime.sessions import Snapshot
from cadence_fx.determinism import byte_view
from cadence_fx.serve.packing import PackLayout, unpack

__all__ = ["AdmissionRefused", "ConversationClosed", "ConversationExists", "ConversationState", "Fenced",
           "NoWorkers", "Placement", "ReplayDiverged", "SequenceError", "StepResult", "UnknownConversation",
           "UnknownSnapshot", "sequence_error"]


class SequenceError(ValueError):
    """A chunk whose sequence number is not the conversation's next: sent twice, or one was skipped."""


class UnknownConversation(LookupError):
    """A call for a conversation this worker or controller never opened."""

    def __str__(self) -> str:  # LookupError's str() would quote the message like a key
        return str(self.args[0]) if self.args else ""


class ConversationClosed(UnknownConversation):
    """A call for a conversation that was closed."""


class UnknownSnapshot(LookupError):
    """A restore token the conversation does not hold (never taken, or dropped as one of the oldest)."""


class ConversationExists(ValueError):
    """``open`` or ``import`` of a conversation id already open here."""


class AdmissionRefused(RuntimeError):
    """No worker has room for another conversation without missing deadlines; the message says why
    (every worker's load and capacity)."""


class NoWorkers(RuntimeError):
    """No live worker is left to place or resume a conversation on."""


class Fenced(RuntimeError):
    """A chunk (or a snapshot) refused because the placement it was sent under is not the conversation's
    any more: it is frozen for a move, moved away, placed again after a failover (a new epoch), or
    being resumed (its state is behind the router's journal). Nothing was applied: ask the controller
    for the placement (``reroute``) and send it there."""


class ReplayDiverged(RuntimeError):
    """A chunk re-run after a failover gave other bytes than the first run sent to the client."""


def sequence_error(conv_id: str, seq: int, expected: int) -> SequenceError:
    """The refusal of chunk ``seq`` when ``expected`` is next, saying which way it is wrong."""
    if seq < expected:
        return SequenceError(f"conversation {conv_id!r}: chunk {seq} was already applied (the next chunk is "
                             f"{expected}): a chunk sent twice is refused, not applied again")
    return SequenceError(f"conversation {conv_id!r}: chunk {seq} skips chunk(s) {expected}..{seq - 1} (the next "
                         f"chunk is {expected}): a chunk is never applied out of order")


@dataclass(frozen=True)
class ConversationState:
    """A conversation as host tensors: what a worker exports and another imports.

    ``state``: each region's tensor (its live extent, contiguous, on the host). ``rng_cpu`` and
    ``rng_cuda`` (one per device the exporting worker sees, or ``None``): the session's random
    streams. ``next_seq``: the sequence number of the conversation's next chunk. ``seed``: the seed it
    was opened with (kept for the record; the streams are the state).
    """

    conv_id: str
    state: Mapping[str, torch.Tensor]
    rng_cpu: torch.Tensor
    rng_cuda: tuple[torch.Tensor, ...] | None
    next_seq: int
    seed: int | None = None
    meta: Mapping[str, float] = field(default_factory=dict)
    # the one host buffer ``state``'s tensors are views of, where the export packed them
    # (:mod:`cadence_fx.serve.packing`): it then crosses the object store as one array
    packed: tuple[torch.Tensor, PackLayout] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of_packed(cls, conv_id: str, flat: torch.Tensor, layout: PackLayout, rng: RngStates | None, *,
                  next_seq: int, seed: int | None) -> "ConversationState":
        """From a packed host buffer (:func:`cadence_fx.serve.packing.pack`, then ``to_host``)."""
        rng = rng if rng is not None else RngStates.current()
        cuda = tuple(t.cpu() for t in rng.cuda) if rng.cuda is not None else None
        return cls(conv_id, unpack(flat, layout), rng.cpu.clone(), cuda, next_seq, seed, packed=(flat, layout))

    def snapshot(self) -> Snapshot:
        """The session snapshot to restore: host tensors (``restore`` copies them into the session's
        buffers on its device). CUDA streams are kept only where this process has as many devices as
        the exporting one (one per worker under Ray); a CPU worker never draws on a device."""
        cuda: list[torch.Tensor] | None = None
        if self.rng_cuda is not None and torch.cuda.is_available():
            if len(self.rng_cuda) != torch.cuda.device_count():
                raise ValueError(f"conversation {self.conv_id!r} was exported with {len(self.rng_cuda)} CUDA "
                                 f"random stream(s) but this worker sees {torch.cuda.device_count()} device(s)")
            cuda = [t.clone() for t in self.rng_cuda]
        return Snapshot(dict(self.state), RngStates(self.rng_cpu.clone(), cuda))

    def nbytes(self) -> int:
        """Bytes of the region tensors (what a move copies)."""
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The region tensors travel as byte arrays: Ray's pickle (protocol 5) hands NumPy arrays to
        # the object store out of band, copied once on put and read in place on get, where a pickled
        # tensor goes through torch's own serialization (a full copy each way; on the CPU, 256 MiB put
        # 406 ms and got 332 ms as a tensor, 138 ms and 1 ms as an array). A byte view keeps every
        # dtype (bfloat16 has no NumPy type) and every bit.
        tail = (self.rng_cpu, self.rng_cuda, self.next_seq, self.seed, dict(self.meta))
        if self.packed is not None:  # one array for the whole state: one object in the store
            flat, layout = self.packed
            return (_unpack_flat, (self.conv_id, flat.numpy(), layout) + tail)
        packed = {n: (_bytes_of(t), t.dtype, tuple(t.shape)) for n, t in self.state.items()}
        return (_unpack_state, (self.conv_id, packed) + tail)


def _bytes_of(t: torch.Tensor) -> Any:
    return byte_view(t).numpy()


def _unpack_state(conv_id: str, packed: Mapping[str, tuple[Any, torch.dtype, tuple[int, ...]]], rng_cpu: torch.Tensor,
                  rng_cuda: tuple[torch.Tensor, ...] | None, next_seq: int, seed: int | None,
                  meta: Mapping[str, float]) -> ConversationState:
    state = {}
    with warnings.catch_warnings():
        # an array read from the object store is read-only: nothing writes these (a restore copies
        # them into the session's buffers), so no copy is made here
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for name, (arr, dtype, shape) in packed.items():
            state[name] = torch.from_numpy(arr).view(dtype).reshape(shape)
    return ConversationState(conv_id, state, rng_cpu, rng_cuda, next_seq, seed, meta)


def _unpack_flat(conv_id: str, arr: Any, layout: PackLayout, rng_cpu: torch.Tensor,
                 rng_cuda: tuple[torch.Tensor, ...] | None, next_seq: int, seed: int | None,
                 meta: Mapping[str, float]) -> ConversationState:
    with warnings.catch_warnings():  # read-only from the object store, and only ever read (as above)
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.from_numpy(arr)
    return ConversationState(conv_id, unpack(flat, layout), rng_cpu, rng_cuda, next_seq, seed, meta,
                             packed=(flat, layout))


@dataclass(frozen=True)
class StepResult:
    """One chunk's outputs (the step's outputs that are not state, on the host) and how it went.

    ``digest``: SHA-256 of the outputs, kept by the controller until the next checkpoint so a chunk
    re-run after a failover is checked against what the client got. ``worker_s``: seconds inside the
    worker's call (what the controller's routing overhead is measured against); ``call_s``: of those,
    the session call with its outputs on the host (what an in-process server would pay for the chunk).
    """

    conv_id: str
    seq: int
    outputs: tuple[torch.Tensor, ...]
    digest: str
    worker: str
    worker_s: float
    call_s: float = 0.0


@dataclass(frozen=True)
class Placement:
    """Where a conversation's state is: ``worker`` (its name) and ``handle`` (its actor), under
    ``epoch`` (the fence token: it changes whenever the conversation changes worker, and a worker
    refuses chunks sent under another). ``next_seq``: the next chunk the worker expects as far as the
    controller knows (behind the router's after a resume, until the router's journal is re-run)."""

    conv_id: str
    worker: str
    handle: Any
    epoch: int
    next_seq: int
