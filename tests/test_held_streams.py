"""Streams held for life are unique: PyTorch's pools hand streams out round robin (32 per priority and
device), and two backends capturing on one stream would share cuBLAS's per-stream workspace, baked into
both backends' graphs. Driven with a stand-in for the pools on the CPU; the CUDA test checks torch's."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from cadence_fx.runtime import streams


class _PoolStream:
    """``torch.cuda.Stream`` as its pools behave: round robin over 32 handles per priority, four priorities."""

    counters: dict[int, itertools.count] = {}

    def __init__(self, device=None, priority: int = 0) -> None:
        level = min(-priority, 3) if priority <= 0 else 0
        n = next(self.counters.setdefault(level, itertools.count()))
        self.device = torch.device("cuda", 0)
        self.cuda_stream = 1000 * (level + 1) + n % 32


class _Owner:
    pass


@pytest.fixture
def pools(monkeypatch):
    _PoolStream.counters = {}
    monkeypatch.setattr(torch.cuda, "Stream", _PoolStream)
    monkeypatch.setattr(streams, "_HELD", {})
    monkeypatch.setattr(streams, "_LOCKS", {})


def test_every_holder_gets_a_stream_of_its_own_until_the_pools_run_out(pools, caplog):
    dev = torch.device("cuda", 0)
    owners = [_Owner() for _ in range(128)]
    got = [streams.held_stream(dev, (-3, -2, 0, -1), o).cuda_stream for o in owners]
    assert len(set(got)) == 128  # four pools of 32, every handle once
    assert not any(streams.shared(_stream(h)) for h in got)
    locks = {id(streams.stream_lock(_stream(h))) for h in got}
    assert len(locks) == 128  # a lock per stream: holders of different streams never wait on each other
    extra = _Owner()
    shared = streams.held_stream(dev, (-3, -2, 0, -1), extra)
    assert shared.cuda_stream in got and "is shared" in caplog.text
    assert streams.shared(shared)  # its holders replay under its one lock
    del extra
    gc.collect()
    assert not streams.shared(shared)  # one holder again


def test_a_released_stream_is_handed_out_again(pools):
    dev = torch.device("cuda", 0)
    a, b = _Owner(), _Owner()
    first = streams.held_stream(dev, (-1,), a).cuda_stream
    second = streams.held_stream(dev, (-1,), b).cuda_stream
    assert first != second
    del a
    gc.collect()
    owners = [_Owner() for _ in range(31)]
    again = [streams.held_stream(dev, (-1,), o).cuda_stream for o in owners]
    assert first in again and second not in again


def _stream(handle: int):
    s = _PoolStream.__new__(_PoolStream)
    s.device, s.cuda_stream = torch.device("cuda", 0), handle
    return s


@pytest.mark.cuda
def test_forty_eight_backends_capture_on_forty_eight_streams():
    """Moshi's three programs with 16 lanes each: every lane's backend its own capture stream."""
    from cadence_fx.runtime.backends import CudaGraphBackend

    root = CudaGraphBackend()
    backends = [root.fork() for _ in range(48)]
    handles = {b._stream("capture").cuda_stream for b in backends}
    assert len(handles) == 48
