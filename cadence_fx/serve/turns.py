"""Turn boundaries of a served conversation: snapshots (kept by token), restores (barge-in), checkpoints.

At a turn boundary a client may keep the conversation's state to come back to (a barge-in rewinds the
assistant's turn and takes it again). The state is a
:class:`~cadence_fx.serve.conversation.ConversationState` exported by the worker; it is put in Ray's
object store by the controller, and the caller gets either the state itself (:meth:`Turns.snapshot`)
or an opaque token (:meth:`Turns.keep_snapshot`: the front end's way, so a snapshot of hundreds of
MiB never travels to a front-end replica). The controller keeps the last ``max_snapshots`` tokens per
conversation and drops them when it closes.

A restore puts the conversation back: its regions, random streams and next chunk number (the
snapshot's: the chunks after it are taken again, as the front end's protocol has it). The restored
state is also the conversation's new checkpoint, and the journal's chunks (the abandoned future) go,
so a failover after a barge-in resumes on the rewound timeline. A conversation a router streams
(:mod:`cadence_fx.serve.router`) that was just resumed at its last checkpoint is behind its router's
journal until the router comes back: its snapshot is refused (``Fenced``) and the router, which
catches up the worker first, takes it. A checkpoint can be taken on demand
too (:meth:`Turns.checkpoint`), besides the policy's every-K and end-of-turn ones.

:class:`Turns` is mixed into :class:`~cadence_fx.serve.controller.ServeController`; every method holds
the conversation's lock, so it happens between two chunks.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from cadence_fx.serve.checkpoints import put_checkpoint
from cadence_fx.serve.conversation import ConversationState, Fenced, UnknownSnapshot

__all__ = ["Turns"]


class Turns:
    """``snapshot``, ``keep_snapshot``, ``restore`` and ``checkpoint`` of the controller."""

    max_snapshots = 8

    if TYPE_CHECKING:
        def _conv(self, conv_id: str) -> Any: ...
        async def _on_worker(self, conv: Any, make: Callable[[Any], Awaitable[Any]]) -> Any: ...
        async def _checkpoint_locked(self, conv: Any, store: str | None = None) -> int: ...

    async def snapshot(self, conv_id: str) -> ConversationState:
        """The conversation's state now, for a later :meth:`restore` (keep the call's object ref and the
        state stays in the object store)."""
        conv = self._conv(conv_id)
        async with conv.cond:
            return await self._snapshot_locked(conv)

    async def keep_snapshot(self, conv_id: str) -> dict[str, Any]:
        """Snapshot the conversation into the object store under a new token: ``{"token", "seq"}`` (the
        next chunk's number at the snapshot)."""
        conv = self._conv(conv_id)
        async with conv.cond:
            state = await self._snapshot_locked(conv)
            token = secrets.token_urlsafe(12)
            conv.snapshots[token] = (put_checkpoint(state), state.next_seq)
            while len(conv.snapshots) > self.max_snapshots:
                conv.snapshots.popitem(last=False)
            return {"token": token, "seq": state.next_seq}

    async def restore(self, conv_id: str, state: ConversationState | str) -> int:
        """Rewind ``conv_id`` to ``state`` (a :class:`ConversationState`, or a token of
        :meth:`keep_snapshot`); returns the next chunk's number (the snapshot's). The restored state is
        the conversation's new checkpoint."""
        conv = self._conv(conv_id)
        async with conv.cond:
            if isinstance(state, str):
                if state not in conv.snapshots:
                    raise UnknownSnapshot(f"conversation {conv_id!r} holds no snapshot {state!r:.40} (it keeps "
                                          f"the last {self.max_snapshots})")
                ref, seq = conv.snapshots[state]
            else:
                if state.conv_id != conv_id:
                    state = replace(state, conv_id=conv_id)
                ref, seq = put_checkpoint(state), state.next_seq
            await self._on_worker(conv, lambda h: h.restore.remote(conv_id, ref))  # resolved by Ray at the worker
            conv.journal.rebased(ref, seq)
            conv.next_seq, conv.lagging = seq, False
            conv.cond.notify_all()
            return seq

    async def _snapshot_locked(self, conv: Any) -> ConversationState:
        if conv.lagging:  # resumed at its base; the chunks since are in its router's journal
            raise Fenced(f"conversation {conv.conv_id!r} was resumed after a failure and its router has not re-run "
                         "its chunks since the checkpoint yet: snapshot it through its router")
        state: ConversationState = await self._on_worker(conv, lambda h: h.snapshot.remote(conv.conv_id))
        return state

    async def checkpoint(self, conv_id: str, store: str | None = None) -> int:
        """Checkpoint ``conv_id`` now (``store``: this once, where its bytes live, as
        ``CheckpointPolicy.store``); returns the chunk number a resume would start at."""
        conv = self._conv(conv_id)
        async with conv.cond:
            return await self._checkpoint_locked(conv, store)
