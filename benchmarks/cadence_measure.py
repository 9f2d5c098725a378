"""The cadence benchmark's measurements beside latency: GPU busy fraction, NVML utilization, timelines.

- :class:`BusyWindow`: a ``torch.profiler`` window of CUDA activity in an SRc worker; the kernels it
  records are clipped to the window and merged (:func:`union_length`: lanes overlap) into a busy
  fraction (:func:`busy_fraction`); :func:`device_busy` pools the windows of processes sharing a GPU.
- :class:`NvmlSampler`: NVML's device-wide utilization, sampled by the coordinator over a run.
  :func:`gpu_name`: the card's name by NVML, before any CUDA context (``--solo-from``'s early check).
- :func:`timeline`: a worker's latency by arrival time, to tell a backlog that builds from a transient.

Latency percentiles are the harness's (:func:`benchmarks.harness.percentile`, nearest rank).
"""

from __future__ import annotations

import json
import threading
import time

import torch

from benchmarks import harness
from benchmarks.cadence_traffic import latency_ms, missed


# --------------------------------------------------------------------------- GPU busy time
def union_intervals(intervals) -> list[tuple[int, int]]:
    """The half-open ``(start, end)`` intervals merged where they overlap or touch, in order."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def union_length(intervals) -> int:
    """Total length covered by the half-open ``(start, end)`` intervals (overlaps counted once)."""
    return sum(e - s for s, e in union_intervals(intervals))


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


def kernel_shape(ev) -> tuple[float, float] | None:
    """A kernel event's (est. achieved occupancy as a fraction, blocks per SM) from its CUPTI metadata
    (Kineto's ``metadata_json``: a JSON object's members without the braces), or None."""
    try:
        meta = json.loads("{" + ev.metadata_json() + "}")
        return float(meta["est. achieved occupancy %"]) / 100.0, float(meta["blocks per SM"])
    except Exception:  # noqa: BLE001 -- an older profiler or another record kind: no figure
        return None


def fill_fractions(intervals, shapes, clip: tuple[int, int]) -> dict:
    """How full the GPU was over ``clip``, beyond "some kernel was running" (the busy fraction):

    - ``warp_fill``: the kernels' est. achieved occupancy (the share of every SM's warp slots a kernel
      can hold, from its grid, block and registers) times their time in the window, summed, over the
      window: 1.0 means kernels held every warp slot of the GPU all the time;
    - ``sm_fill``: the same with the share of SMs a kernel's grid covers (``min(1, blocks per SM)``).

    Both count only kernels with a CUPTI record (``fill_kernels`` of ``fill_of``); they are upper bounds
    (a kernel slowed by its neighbours still counts its whole duration)."""
    lo, hi = clip
    warp = sm = 0.0
    seen = total = 0
    for (s, e), shp in zip(intervals, shapes):
        if e <= lo or s >= hi:
            continue
        total += 1
        if shp is None:
            continue
        seen += 1
        t = min(e, hi) - max(s, lo)
        warp += shp[0] * t
        sm += min(1.0, shp[1]) * t
    if not seen:
        return dict(warp_fill=None, sm_fill=None)
    span = max(1, hi - lo)
    return dict(warp_fill=warp / span, sm_fill=sm / span, fill_kernels=seen, fill_of=total)


class BusyWindow(threading.Thread):
    """A CUDA-activity profiler window of ``seconds`` from ``start`` (perf_counter time).

    The profiler's session belongs to the thread that starts it, so this thread starts it and also
    stops it, but only when :meth:`finish` is called after the run: stopping parses the trace with
    the GIL held, which would stall the serving threads. Kernels are clipped to the window on the
    profiler's clock (wall-clock nanoseconds, like ``time.time_ns``), so the rest of the run is not
    counted; where no recorded kernel falls inside the window (another clock), the fraction is over
    the recorded span instead and ``busy_clock`` says so.
    """

    def __init__(self, start: float, seconds: float, device: str = "cuda", keep_union: bool = False) -> None:
        super().__init__(daemon=True)
        self.start_at, self.seconds, self.device = start, seconds, device  # "cpu": host ops (the CPU test)
        # also return the merged kernel intervals inside the window (``busy_union``, ``busy_clip``): a GPU
        # shared by several processes is busy where any of them runs a kernel (:func:`device_busy`)
        self.keep_union = keep_union
        self.prof = None
        self.wall_ns = 0
        self.perf_start = None
        self.error = None
        self.intervals: list[tuple[int, int]] = []
        # per kernel, in the order of ``intervals``: (est. achieved occupancy, blocks per SM) from the
        # kernel's CUPTI record, or None where the profiler gives none (to tell a full GPU from one whose
        # kernels are merely always there: see :func:`fill_fractions`)
        self.shapes: list[tuple[float, float] | None] = []
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
                self.shapes.append(kernel_shape(ev) if kind == torch.autograd.DeviceType.CUDA else None)
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
        out = dict(busy_fraction=frac, busy_kernels=inside or len(self.intervals), busy_clock=clock,
                   busy_window=window, kernel_sum_fraction=summed / max(1, hi - lo),
                   **fill_fractions(self.intervals, self.shapes, (lo, hi)))
        if self.keep_union and clock == "wall":  # another process's window is on the same wall clock
            out.update(busy_union=[[max(s, lo), min(e, hi)] for s, e in union_intervals(self.intervals)
                                   if e > lo and s < hi], busy_clip=[lo, hi])
        return out


def device_busy(parts: list[dict]) -> list[dict]:
    """Per GPU, from the worker processes' parts on it (``gpu``): how busy the GPU was. One process: its
    own figures. Several (``--procs-per-gpu``): the GPU is busy where any of them ran a kernel, so the
    busy fraction is the union of their windows' merged intervals (``busy_union``) over the span all
    their windows cover; the kernels' summed time and fills add up over the processes (each over its
    own window, a few milliseconds apart). A process without a window leaves the GPU's figures None."""
    by: dict[int, list[dict]] = {}
    for p in parts:
        by.setdefault(p["gpu"], []).append(p)
    out = []
    for gpu, ps in sorted(by.items()):
        keys = ("busy_fraction", "kernel_sum_fraction", "warp_fill", "sm_fill")
        if len(ps) == 1:
            out.append(dict(gpu=gpu, processes=1, **{k: ps[0].get(k) for k in keys}))
            continue
        if not all(p.get("busy_union") is not None for p in ps):
            out.append(dict(gpu=gpu, processes=len(ps), **{k: None for k in keys}))
            continue
        lo = max(p["busy_clip"][0] for p in ps)
        hi = min(p["busy_clip"][1] for p in ps)
        ivs = [(max(s, lo), min(e, hi)) for p in ps for s, e in p["busy_union"] if e > lo and s < hi]
        row = dict(gpu=gpu, processes=len(ps), busy_fraction=union_length(ivs) / max(1, hi - lo))
        for k in keys[1:]:
            vals = [p.get(k) for p in ps]
            row[k] = sum(vals) if all(v is not None for v in vals) else None
        out.append(row)
    return out


def nvml_handles(gpus: list[str]) -> list:
    """NVML's handles of ``gpus`` (``CUDA_VISIBLE_DEVICES`` entries: indices or UUIDs); raises without
    pynvml. NVML opens no CUDA context, so the parent of MPS clients may ask."""
    import pynvml

    pynvml.nvmlInit()
    return [pynvml.nvmlDeviceGetHandleByIndex(int(g)) if g.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(g)
            for g in gpus]


def gpu_name(visible: list[str]) -> str | None:
    """The name of the first GPU handed out, as ``torch.cuda.get_device_name`` gives it; ``None``
    without a GPU or without pynvml."""
    if not visible:
        return None
    try:
        import pynvml

        name = pynvml.nvmlDeviceGetName(nvml_handles(visible[:1])[0])
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 -- no NVML: the workers' own report is checked later
        return None


def gpu_memory_line(gpu: str) -> str:
    """What NVML says is in use on ``gpu`` (a ``CUDA_VISIBLE_DEVICES`` entry): the device's used and total
    MiB and each process's, for the error of a worker that died starting (an allocation that fails
    below the device's total names who held the rest); an empty string without NVML."""
    try:
        import pynvml

        h = nvml_handles([gpu])[0]
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    except Exception:  # noqa: BLE001 -- no NVML: the worker's own traceback is all there is
        return ""
    per = ", ".join(f"pid {p.pid} {(p.usedGpuMemory or 0) / 2**20:.0f}" for p in procs)
    return f"gpu {gpu} memory (NVML): {mem.used / 2**20:.0f} of {mem.total / 2**20:.0f} MiB used; {per or 'no process listed'}\n"


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

            handles = nvml_handles(self.gpus)
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
