"""What a torch.profiler trace says about a run's host and GPU time, in a few numbers (a diagnostic).

Used by ``benchmarks/moshi_sessions.py --profile N``: where sessions served at once leave the GPU idle
while the host is idle too, the answer is in which runtime calls block (graph launches, synchronizes,
copies, allocations) and how much of the wall any kernel ran.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from benchmarks.cadence_measure import union_length


def summarize(prof: Any, wall_s: float, top: int = 12) -> dict:
    """Runtime API calls by total host time (count, total and max ms), the union of kernel time over the
    wall (busy), the kernels' summed time over that union (average kernels at once), and busy per stream.
    (The profiler records Python-level ops only on the thread that started it; CUPTI's runtime calls and
    kernels are every thread's.)"""
    api: dict[str, list[float]] = defaultdict(list)
    kernels: list[tuple[float, float]] = []
    per_stream: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for ev in prof.events():
        dt = str(getattr(ev, "device_type", ""))
        start, end = ev.time_range.start, ev.time_range.end
        if dt.endswith("CUDA"):
            kernels.append((start, end))
            per_stream[getattr(ev, "device_resource_id", ev.thread)].append((start, end))
        elif ev.name.startswith("cu"):  # the runtime and driver calls (cudaGraphLaunch, cuLaunchKernel, ...)
            api[ev.name].append(end - start)
    union = union_length(kernels)
    summed = sum(b - a for a, b in kernels)
    rows = sorted(((name, len(v), sum(v) / 1e3, max(v) / 1e3) for name, v in api.items()),
                  key=lambda r: -r[2])[:top]
    return {
        "wall_s": wall_s,
        "busy": union / 1e6 / wall_s if wall_s else None,
        "kernels_at_once": summed / union if union else None,
        "kernel_count": len(kernels),
        "runtime_api": [{"name": n, "count": c, "total_ms": t, "max_ms": m} for n, c, t, m in rows],
        "streams": sorted((union_length(v) / 1e6 / wall_s for v in per_stream.values()), reverse=True)[:16],
    }


def print_summary(s: dict, file: Any) -> None:
    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    print(f"profile: wall {s['wall_s']:.2f} s, busy {f(s['busy'])}, kernels at once {f(s['kernels_at_once'])}, "
          f"{s['kernel_count']} kernels", file=file)
    for r in s["runtime_api"]:
        print(f"  {r['name']:<34} {r['count']:>7} calls {r['total_ms']:>10.1f} ms total {r['max_ms']:>8.2f} ms max",
              file=file)
    print("  busy per stream:", [round(v, 3) for v in s["streams"]], file=file, flush=True)
