"""What enters and leaves a worker whole: a conversation exported, imported, or handed off on the GPU.

:class:`Transfers` is mixed into :class:`~cadence_fx.serve.worker.ConversationWorker`: the snapshot of a
conversation to the host (a checkpoint, a move through the object store, a barge-in's token), its
import on another worker, and the handoff of a move between two workers on one GPU
(:mod:`cadence_fx.serve.handoff`). Every export is packed first (:mod:`cadence_fx.serve.packing`):
one copy per region on the device into one buffer, then one transfer of the whole. The worker
module keeps the conversations' life (open, step, close) and the worker's own; this one only moves
their bytes, under the same per-conversation lock, so a chunk never runs while its state is read.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from cadence_fx.runtime.sessions import Session, Snapshot
from cadence_fx.serve import packing
from cadence_fx.serve.conversation import ConversationState
from cadence_fx.serve.handoff import DeviceHandoff, HandoffUnavailable, share

__all__ = ["Transfers"]


class Transfers:
    """Exports, imports and handoffs of :class:`~cadence_fx.serve.worker.ConversationWorker` (see the
    module docstring)."""

    if TYPE_CHECKING:
        import threading

        name: str
        prog: Any
        device: torch.device
        identity: str | None
        _lock: threading.Lock
        _handoffs: dict[str, torch.Tensor]

        def _get(self, conv_id: str) -> Any: ...
        def _admit(self, conv_id: str, *, replace: bool, force: bool) -> None: ...
        def _adopt(self, conv_id: str, session: Session, state: dict[str, torch.Tensor], next_seq: int,
                   seed: int | None, epoch: int) -> None: ...
        def _to_device(self, x: Any) -> Any: ...

    def snapshot(self, conv_id: str, *, freeze: bool = False) -> ConversationState:
        """The conversation's state now (a turn boundary), on the host; the conversation goes on here
        (``freeze``: it takes no chunk until it is closed as moved or thawed: the first half of a move)."""
        t0 = time.perf_counter()
        conv = self._get(conv_id)
        with conv.lock:
            conv.frozen = conv.frozen or freeze
            flat, layout, rng = self._pack(conv)
            next_seq = conv.next_seq
        host = packing.to_host(flat)  # one transfer into pinned memory, outside the conversation's lock
        state = ConversationState.of_packed(conv_id, host, layout, rng, next_seq=next_seq, seed=conv.seed)
        return replace(state, meta={"export_s": time.perf_counter() - t0})

    def handoff(self, conv_id: str) -> DeviceHandoff:
        """The first half of a move to a worker on this GPU (:mod:`cadence_fx.serve.handoff`): the
        conversation frozen, packed into one buffer on the device and shared by a CUDA IPC handle;
        the buffer is kept until the move is closed (``close(moved=True)``) or undone (``thaw``).
        Raises :class:`HandoffUnavailable` on a worker that is not on a GPU."""
        t0 = time.perf_counter()
        if self.identity is None:
            raise HandoffUnavailable(f"worker {self.name} is on {self.device}: no device handoff")
        conv = self._get(conv_id)
        with conv.lock:
            conv.frozen = True
            flat, layout, rng = self._pack(conv)
            next_seq = conv.next_seq
        with self._lock:
            self._handoffs[conv_id] = flat
        try:
            return share(conv_id, flat, layout, self.identity, rng, next_seq=next_seq, seed=conv.seed,
                         meta={"export_s": time.perf_counter() - t0})
        except RuntimeError as e:  # the allocator cannot share this block (e.g. expandable segments)
            self._release_handoff(conv_id)  # still frozen: the move goes on through the object store
            raise HandoffUnavailable(f"worker {self.name}: sharing {conv_id!r}'s buffer failed: {e}") from e

    def import_handoff(self, conv_id: str, handoff: DeviceHandoff, *, epoch: int = 0) -> int:
        """Open ``conv_id`` here from another worker's :meth:`handoff` on this GPU (its regions copied
        device to device; the mapping is let go before this returns, so the source may free its
        buffer). Raises :class:`HandoffUnavailable` where the buffer cannot be mapped here: nothing
        was opened, and the move can go through the object store. Returns the state's bytes."""
        snap, mapping = handoff.open(self.identity)
        try:
            self._admit(conv_id, replace=False, force=False)
            session = self.prog.session(conv_id, seed=handoff.seed)
            try:
                returned = session.restore(snap)
                torch.cuda.current_stream(self.device).synchronize()  # the copies read the mapping
            except BaseException:
                session.close()
                raise
        finally:
            del snap, mapping
        self._adopt(conv_id, session, returned, handoff.next_seq, handoff.seed, epoch)
        return handoff.nbytes()

    def export_conversation(self, conv_id: str, *, freeze: bool = False) -> ConversationState:
        """The conversation as host tensors for the object store (a move or a checkpoint): its
        snapshot and the next chunk's number. It stays open here until :meth:`close`."""
        return self.snapshot(conv_id, freeze=freeze)

    def checkpoint(self, conv_id: str, *, freeze: bool = False) -> tuple[ConversationState, dict[str, Any]]:
        """The export and a small header of it (next chunk, bytes, seconds): called with two returns, the
        state stays in this node's object store while the controller reads only the header."""
        state = self.export_conversation(conv_id, freeze=freeze)
        return state, {"next_seq": state.next_seq, "nbytes": state.nbytes(), **state.meta}

    def import_conversation(self, conv_id: str, state: ConversationState, *, replace: bool = False,
                            force: bool = False, epoch: int = 0) -> int:
        """Open ``conv_id`` here from an exported state under ``epoch``: its next chunk is
        ``state.next_seq``. Returns the state's bytes."""
        self._admit(conv_id, replace=replace, force=force)
        session = self.prog.session(conv_id, seed=state.seed)
        returned = self._restore_into(session, state)
        self._adopt(conv_id, session, returned, state.next_seq, state.seed, epoch)
        return state.nbytes()

    def _pack(self, conv: Any) -> tuple[torch.Tensor, packing.PackLayout, Any]:
        """The conversation's state packed into one new buffer on its device, finished (the caller
        holds ``conv.lock``: the next chunk must not write the buffers while the copies read them)."""
        (flat, layout), rng = conv.session.read_state(packing.pack)
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()
        return flat, layout, rng

    def _release_handoff(self, conv_id: str) -> None:
        with self._lock:
            flat = self._handoffs.pop(conv_id, None)
        if flat is not None:
            del flat
            torch.cuda.ipc_collect()  # a block the target still mapped is freed once it lets go

    def _restore_into(self, session: Session, state: ConversationState) -> dict[str, torch.Tensor]:
        snap = state.snapshot()
        return session.restore(Snapshot({n: self._to_device(t) for n, t in snap.state.items()}, snap.rng))
