"""The cadence benchmark's traffic: the conversation scripts and the deadline clock.

A session is one conversation and follows one of ``--scripts`` scripts (session ``i`` follows script
``i % scripts``): a token stream (:func:`script_tokens`) and a random seed. Chunk ``k`` of session
``i`` of ``n`` arrives at ``t0 + i * period / n + k * period`` (:func:`first_arrival` is its ``k = 0``)
and is late (a miss) when its PCM is on the host more than one ``period`` after it arrived.

Every process reports what it served as records ``[session, chunk, arrival s, ready s]``, times
from the run's shared ``t0``; :func:`latency_ms` and :func:`missed` read them.
"""

from __future__ import annotations


def chunks_per_session(seconds: float, period: float) -> int:
    """How many chunks a conversation of ``seconds`` has, one every ``period`` (at least one)."""
    return max(1, int(round(seconds / period)))


def script_tokens(bench, script: int, chunks: int):
    """The per-chunk inputs of script ``script``: the same in every process that builds the same model."""
    return bench.step.fresh(chunks, bench.spk, seed=10_000 + script)


def first_arrival(t0: float, i: int, n: int, period: float) -> float:
    """When session ``i`` of ``n`` sends its first chunk: the sessions are staggered over one period."""
    return t0 + i * period / n


def deadline_ms(period: float) -> float:
    """The latency a chunk may take, ms: one period (a 1 s chunk must be played within 1 s)."""
    return period * 1e3


def latency_ms(record) -> float:
    """A record's latency, arrival to PCM on the host, ms (queueing included)."""
    return (record[3] - record[2]) * 1e3


def missed(ms: float, period: float) -> bool:
    """Whether a latency of ``ms`` is a deadline miss (a playback underrun)."""
    return ms > deadline_ms(period)
