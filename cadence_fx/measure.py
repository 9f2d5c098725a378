"""Measurement helpers shared by the demo and the benchmarks (timing, launches, memory, stream hashes)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cadence_fx.determinism import sha256_tensors

_LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class StreamResult:
    """Per-call latencies (ms), the SHA-256 of everything the stream emitted, and peak memory."""

    ms: list[float] = field(default_factory=list)
    sha256: str = ""
    peak_mib: float | None = None
    launches_per_call: float | None = None
    kernels_per_call: float | None = None

    def p(self, q: float) -> float:
        xs = sorted(self.ms)
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")

    @property
    def p50(self) -> float:
        return statistics.median(self.ms) if self.ms else float("nan")


def time_stream(step: Callable[[int], Sequence[torch.Tensor]], calls: int, *, emitted: Callable[[Any], Sequence[torch.Tensor]]
                ) -> StreamResult:
    """Run ``step(k)`` for k in range(calls), timing each call to completion and hashing what it emits."""
    res = StreamResult()
    out_bytes: list[torch.Tensor] = []
    for k in range(calls):
        sync()
        t0 = time.perf_counter()
        out = step(k)
        sync()
        res.ms.append((time.perf_counter() - t0) * 1e3)
        out_bytes.extend(t.detach().clone() for t in emitted(out))
    res.sha256 = sha256_tensors(out_bytes)
    return res


def count_launches(fn: Callable[[], Any], *, calls: int = 1) -> tuple[float, float]:
    """(host launch API calls, device kernels) per call of ``fn``, read with the torch profiler."""
    p = profile_calls(fn, calls=calls)
    return p["launches"], p["kernels"]


def profile_calls(fn: Callable[[], Any], *, calls: int = 1) -> dict[str, float]:
    """Per call of ``fn``: host launch API calls, device kernels, and device busy time (the sum of
    kernel durations, ms: the floor a launch-free schedule of the same kernels could reach)."""
    nan = float("nan")
    if not torch.cuda.is_available():
        return {"launches": nan, "kernels": nan, "busy_ms": nan}
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    launches = kernels = 0
    busy_us = 0.0
    for ev in prof.events():
        if ev.name in _LAUNCH_APIS:
            launches += 1
        elif getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and "Memcpy" not in ev.name \
                and "Memset" not in ev.name:
            kernels += 1
            busy_us += ev.time_range.elapsed_us()
    return {"launches": launches / calls, "kernels": kernels / calls, "busy_ms": busy_us / 1e3 / calls}


def peak_mib(reset: bool = False) -> float | None:
    if not torch.cuda.is_available():
        return None
    sync()
    value = torch.cuda.max_memory_allocated() / 2**20
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return value
