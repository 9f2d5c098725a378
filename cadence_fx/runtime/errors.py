"""The errors a state input can raise: kept from an older call, or not this region's at all."""

from __future__ import annotations

__all__ = ["NoLaneToPin", "StaleState", "StateMismatch", "stale_message"]


class StaleState(RuntimeError):
    """A state input that is a view of a region buffer other than the state the last call returned."""


def stale_message(name: str, input_name: str) -> str:
    return (f"region {name!r}: input {input_name!r} is a view of a region buffer but not the state the last "
            f"call returned (a state kept from an older call, or a view of one). Its bytes were overwritten "
            f"when a later call wrote the region in place. Feed back the state each call returns as it is; "
            f"to keep a state for later (a retry, a rewind), clone it when it is returned (or take a session "
            f"snapshot) and pass the copy.")


class StateMismatch(ValueError):
    """A state tensor that cannot be this region's: another dtype, rank or shape (a snapshot of
    another model, a float64 state for a float32 region)."""


class NoLaneToPin(RuntimeError):
    """``program.session(pin=True)`` when every lane a session may pin is pinned already."""
