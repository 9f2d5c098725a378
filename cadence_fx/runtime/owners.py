"""Who owns a state buffer, process-wide: every program's lane buffers and every session's buffers.

A state input that is a view of *some* contract-owned buffer is either the state its owner's last
call returned (current bytes: copied in, or used in place by that owner) or a view kept from an
older call, whose bytes a later call overwrote (refused with :class:`StaleState`). That holds across
programs too: an older state of one program fed to another program of the same model is stale
there as well, so the table is one per process, not one per program.

Owners are held weakly: a session dropped without ``close()`` is reclaimed, and its entries go with
it (a view the caller still holds keeps the storage, hence its bytes, alive; it is then a plain
tensor to every program).

The owners of a program's own lane buffers are here too: :class:`DefaultState` (the default
session's state, resident in lane 0's buffers until a session evicts it) and :class:`NoReturned`
(the other lanes, where no state stays between calls).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch

from cadence_fx.runtime.errors import StaleState, stale_message

if TYPE_CHECKING:
    from cadence_fx.runtime.lanes import Lane

__all__ = ["DefaultState", "NoReturned", "StateOwner", "owner_of", "register", "resolve_source", "unregister"]


class StateOwner(Protocol):
    """A session, the default session, or a lane no session's state stays in."""

    def last_returned(self) -> dict[str, torch.Tensor]: ...
    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor: ...


_lock = threading.Lock()
_owners: dict[int, "weakref.ref[Any]"] = {}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def register(owner: StateOwner, buffers: Iterable[torch.Tensor]) -> None:
    """Record ``owner`` as the owner of ``buffers`` until it is unregistered or collected."""
    keys = [_key(b) for b in buffers if b.untyped_storage().nbytes()]

    def gone(ref: "weakref.ref[Any]", keys: list[int] = keys) -> None:
        with _lock:
            for k in keys:
                if _owners.get(k) is ref:
                    del _owners[k]

    ref = weakref.ref(owner, gone)
    with _lock:
        for k in keys:
            _owners[k] = ref


def unregister(owner: StateOwner, buffers: Iterable[torch.Tensor]) -> None:
    with _lock:
        for b in buffers:
            ref = _owners.get(_key(b))
            if ref is not None and ref() is owner:
                del _owners[_key(b)]


def owner_of(t: torch.Tensor) -> StateOwner | None:
    """The owner of the buffer ``t`` views, if it views one."""
    ref = _owners.get(_key(t))
    return None if ref is None else ref()


def resolve_source(name: str, arg: Any, input_name: str,
                   returned: dict[int, set[int]] | None = None) -> torch.Tensor:
    """Where a state input's bytes are: ``arg`` itself (a foreign tensor: a prompt's state, a snapshot,
    a clone), the current bytes of the owner whose last returned state it is, or :class:`StaleState`.

    ``returned``: a memo the caller keeps across one call's regions (owner id -> ids of the tensors it
    last returned), so a call of R regions asks each owner once instead of R times (a Moshi LM call has
    99 regions: the repeated asks were a fifth of a session call's host time)."""
    if not isinstance(arg, torch.Tensor):
        raise TypeError(f"region {name!r}: expected a tensor for input {input_name!r}, got {type(arg).__name__}")
    owner = owner_of(arg)
    if owner is None:
        return arg
    if returned is None:
        last = {id(t) for t in owner.last_returned().values()}
    else:
        last = returned.get(id(owner))
        if last is None:
            last = returned[id(owner)] = {id(t) for t in owner.last_returned().values()}
    if id(arg) in last:
        return owner.current_bytes(arg)
    raise StaleState(stale_message(name, input_name))


class DefaultState:
    """The program's own calls (the default session): their state stays in lane 0's buffers, until a
    session that needs lane 0 copies it out (evicts it) into buffers of its own."""

    def __init__(self, lane: "Lane") -> None:
        self.lane = lane
        self.evicted: dict[str, torch.Tensor] = {}  # region -> the default state's bytes, once evicted
        self.returned: dict[str, torch.Tensor] = {}  # what the default session's last call returned

    def last_returned(self) -> dict[str, torch.Tensor]:
        return dict(self.returned)

    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor:
        for name, t in self.returned.items():
            if t is returned and name in self.evicted:
                return self.evicted[name]
        return returned


class NoReturned:
    """The owner of a lane's buffers other than lane 0's: no session's state is ever left there."""

    def last_returned(self) -> dict[str, torch.Tensor]:
        return {}

    def current_bytes(self, returned: torch.Tensor) -> torch.Tensor:
        return returned
