"""The Ray settings a conversation service wants: chunk replies inside the actor call's own message.

Ray returns a task's value inline (in the reply to the call) only up to ``max_direct_call_object_size``
(100 KiB by default); a larger one is put into the worker's object store and fetched from there by
the caller: one more copy, an object-store round trip and its bookkeeping, per chunk. A chunk's reply
is usually just over that: a second of 24 kHz float32 PCM is 94 KiB before its mel and the reply's
header. On this project's CPU an actor call returning 112 KB took p50 1.76 / p99 2.54 ms through the
store and 0.99 / 1.20 ms inline (docs/serving.md, "Ray settings"). :data:`SYSTEM_CONFIG` raises the
limit to 2 MiB, which covers a chunk's reply with room and still sends conversation states (hundreds
of MiB) through the object store, out of band.

The setting is the cluster's (every process reads it at start): pass :func:`system_config` to
``ray.init(_system_config=...)`` where the driver starts Ray (:func:`init` does), to
``ray.cluster_utils.Cluster(head_node_args={"_system_config": ...})``, or to ``ray start --head
--system-config='{"max_direct_call_object_size": 2097152}'`` on a cluster.
"""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["SYSTEM_CONFIG", "init", "system_config"]

SYSTEM_CONFIG: dict[str, Any] = {"max_direct_call_object_size": 2 << 20}


def system_config(**overrides: Any) -> dict[str, Any]:
    """:data:`SYSTEM_CONFIG` with ``overrides`` (Ray system-config keys) on top."""
    return {**SYSTEM_CONFIG, **overrides}


def init(**kwargs: Any) -> Any:
    """``ray.init(**kwargs)`` starting a local Ray with :data:`SYSTEM_CONFIG` merged into any
    ``_system_config`` given (a connection to a running cluster takes that cluster's settings)."""
    if kwargs.get("address") in (None, "local"):
        kwargs["_system_config"] = system_config(**kwargs.get("_system_config", {}))
    return ray.init(**kwargs)
