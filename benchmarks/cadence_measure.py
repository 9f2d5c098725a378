"""The cadence benchmark's measurements beside latency: GPU busy fraction, NVML utilization, timelines.

- :class:`BusyWindow`: a ``torch.profiler`` window of CUDA activity in an SRc worker; the kernels it
  records are clipped to the window and merged (:func:`union_length`: lanes overlap) into a busy
  fraction (:func:`busy_fraction`).
- :class:`NvmlSampler`: NVML's device-wide utilization, sampled by the coordinator over a run.
- :func:`timeline`: a worker's latency by arrival time, to tell a backlog that builds from a transient.

Latency percentiles are the harness's (:func:`benchmarks.harness.percentile`, nearest rank).
"""

from __future__ import annotations

import threading
import time

import torch

from benchmarks import harness
from benchmarks.cadence_traffic import latency_ms, missed


# --------------------------------------------------------------------------- GPU busy time
def union_length(intervals) -> int:
    """Total length covered by the half-open ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def busy_fraction(intervals_ns, window_ns: int, clip: tuple[int, int] | None = None) -> float | None:
    """Union of kernel intervals over the window. ``clip``: count only what lies in ``[start, end)``
    (the window, on the kernels' clock); without it the denominator is the window or the kernels'
    span, whichever is longer."""
    if window_ns <= 0:
        return None
    if clip is not None:
        lo, hi = clip
        intervals_ns = [(max(s, lo), min(e, hi)) for s, e in intervals_ns if e > lo and s < hi]
    if not intervals_ns:
        return 0.0
    span = max(e for _s, e in intervals_ns) - min(s for s, _e in intervals_ns)
    return union_length(intervals_ns) / (window_ns if clip is not None else max(window_ns, span))


class BusyWindow(threading.Thread):
    """A CUDA-activity profiler window of ``seconds`` from ``start`` (perf_counter time).

    The profiler's session belongs to the thread that starts it, so this thread starts it and also
    stops it, but only when :meth:`finish` is called after the run: stopping parses the trace with
    the GIL held, which would stall the serving threads. Kernels are clipped to the window on the
    profiler's clock (wall-clock nanoseconds, like ``time.time_ns``), so the rest of the run is not
    counted; where no recorded kernel falls inside the window (another clock), the fraction is over
    the recorded span instead and ``busy_clock`` says so.
    """

    def __init__(self, start: float, seconds: float, device: str = "cuda") -> None:
        super().__init__(daemon=True)
        self.start_at, self.seconds, self.device = start, seconds, device  # "cpu": host ops (the CPU test)
        self.prof = None
        self.wall_ns = 0
        self.perf_start = None
        self.error = None
        self.intervals: list[tuple[int, int]] = []
        self.run_over = threading.Event()

    @staticmethod
    def warm() -> None:
        """Initialize CUPTI once, in the main thread, before any timed run (its first start is slow)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]):
            torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()

    def run(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        try:
            wait = self.start_at - time.perf_counter()
            if wait > 0 and self.run_over.wait(wait):
                self.error = "the run ended before the window"
                return
            act = ProfilerActivity.CUDA if self.device == "cuda" else ProfilerActivity.CPU
            self.prof = profile(activities=[act])  # CUDA: no host-side op recording
            self.prof.start()
            self.wall_ns, self.perf_start = time.time_ns(), time.perf_counter()
            self.run_over.wait()
            self.prof.stop()
            kind = torch.autograd.DeviceType.CUDA if self.device == "cuda" else torch.autograd.DeviceType.CPU
            for ev in self.prof.profiler.kineto_results.events():
                if ev.device_type() != kind:
                    continue
                name = ev.name().lower()
                if "memcpy" in name or "memset" in name:
                    continue
                self.intervals.append((ev.start_ns(), ev.start_ns() + ev.duration_ns()))
        except Exception as e:  # noqa: BLE001 -- a failed window costs the figure, not the run
            self.error = repr(e)

    def finish(self, base: float) -> dict:
        """After the run: stop the profiler and measure; ``base``: the run's t0 on the perf clock."""
        self.run_over.set()
        self.join()
        if self.error or self.perf_start is None:
            return dict(busy_fraction=None, busy_error=self.error or "no window")
        window = (self.perf_start - base, self.perf_start - base + self.seconds)
        if self.device == "cuda" and not self.intervals:  # an idle GPU still runs the chunks' kernels
            return dict(busy_fraction=None, busy_error="no kernel recorded", busy_window=window)
        w_ns = int(self.seconds * 1e9)
        clip = (self.wall_ns, self.wall_ns + w_ns)
        inside = sum(1 for s, e in self.intervals if e > clip[0] and s < clip[1])
        if inside or not self.intervals:
            frac, clock = busy_fraction(self.intervals, w_ns, clip), "wall"
        else:
            frac, clock = busy_fraction(self.intervals, w_ns), "span"
        lo, hi = clip if clock == "wall" else (min(s for s, _e in self.intervals), max(e for _s, e in self.intervals))
        summed = sum(min(e, hi) - max(s, lo) for s, e in self.intervals if e > lo and s < hi)
        # summed kernel time over the window: above the union where lanes' kernels overlap
        return dict(busy_fraction=frac, busy_kernels=inside or len(self.intervals), busy_clock=clock,
                    busy_window=window, kernel_sum_fraction=summed / max(1, hi - lo))


class NvmlSampler(threading.Thread):
    """NVML utilization of the given GPUs every ``every`` s while running (nothing without pynvml)."""

    def __init__(self, gpus: list[str], every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.gpus, self.every = gpus, every
        self.samples: list[list[float]] = [[] for _ in gpus]
        self.stop_at = float("inf")
        self.start_at = 0.0
        self.error = None

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(int(g)) if g.isdigit()
                       else pynvml.nvmlDeviceGetHandleByUUID(g) for g in self.gpus]
            while time.time() < self.stop_at:
                if time.time() >= self.start_at:
                    for i, h in enumerate(handles):
                        self.samples[i].append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100)
                time.sleep(self.every)
        except Exception as e:  # noqa: BLE001 -- no pynvml, no NVML figure
            self.error = repr(e)

    def result(self) -> dict:
        per = [sum(s) / len(s) if s else None for s in self.samples]
        vals = [v for v in per if v is not None]
        return dict(nvml_util=sum(vals) / len(vals) if vals else None, nvml_util_per_gpu=per)


# --------------------------------------------------------------------------- latency over the run
def timeline(records: list[list[float]], period: float, window: float = 10.0) -> list[list[float]]:
    """Latency by arrival time: per ``window``-second slice of arrivals, ``[start s, p50 ms, p99 ms,
    misses]`` (misses: over ``period``), to tell a backlog that builds from a transient."""
    window = max(window, 10.0 * period)
    by: dict[int, list[float]] = {}
    for r in records:
        by.setdefault(int(r[2] // window), []).append(latency_ms(r))
    return [[w * window, round(harness.percentile(v, 50), 1), round(harness.percentile(v, 99), 1),
             sum(missed(x, period) for x in v)] for w, v in sorted(by.items())]
