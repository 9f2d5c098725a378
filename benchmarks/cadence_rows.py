"""The cadence benchmark's rows: one per (cell, GPU count, N), merged from every process's part.

:func:`merge_row` pools the per-GPU parts of one run into a row (latency percentiles, misses, peak
memory, busy fraction, joins, the exactness gate); :func:`limits` reads the largest N without a miss
per cell and GPU count; :func:`table` and :func:`progress` print rows. Rows are written as they come
(``--rows``, JSON lines, and the ``--json`` report, rewritten after every row) by
:meth:`benchmarks.cadence_run.Run.add`, with the harness's writers.
"""

from __future__ import annotations

from benchmarks import harness
from benchmarks.cadence_exact import bitexact, session_digests
from benchmarks.cadence_measure import device_busy
from benchmarks.cadence_traffic import latency_ms, missed
from benchmarks.harness import fmt_number as fmt  # a number in a format, "n/a" for none or nan


def merge_row(cell: str, g: int, n: int, parts: list[dict], solo: dict[int, str], scripts: int, period: float,
              chunks: int) -> dict:
    """One row from the per-GPU parts of one run: ``records`` ([session, chunk, arrival s, ready s],
    times from the shared t0), ``sha`` (session -> PCM digest), ``joins`` ([session, t s, ms]),
    ``peak_mib`` and, where measured, ``busy_fraction``.

    ``bitexact``: every session served all its chunks and its PCM equals its script's solo stock run.
    """
    lat = [latency_ms(r) for p in parts for r in p["records"]]
    abandoned = sum(p.get("abandoned", 0) for p in parts)  # a cut row's chunks never served: each a miss
    misses = sum(missed(x, period) for x in lat) + abandoned
    sha = session_digests(parts)
    # a cut row's streams are incomplete: their digests cannot be the solo runs', so exactness is not judged
    exact = None if abandoned else bitexact(parts, n, solo, scripts, chunks)
    joins = [j for p in parts for j in p["joins"]]
    join_ms = [j[2] for j in joins]
    # other sessions' chunks, on the joiner's GPU, pending at a live join or arriving in the second after it
    window_misses = 0
    for p in parts:
        for i, tj, _ms in p["joins"]:
            if tj < 0:
                continue
            window_misses += sum(1 for r in p["records"] if r[0] != i and tj - period < r[2] <= tj + period
                                 and missed(latency_ms(r), period))
    per_gpu = []
    profiled_misses = None
    for p in parts:
        pl = [latency_ms(r) for r in p["records"]]
        if p.get("busy_window"):  # the profiler is on from the window's start to the end of the run
            w0 = p["busy_window"][0]
            profiled_misses = (profiled_misses or 0) + sum(1 for r in p["records"] if r[3] > w0
                                                           and missed(latency_ms(r), period))
        per_gpu.append(dict(gpu=p["gpu"], slot=p.get("slot", 0), sessions=len(p["sha"]), chunks=len(pl), p50_ms=harness.percentile(pl, 50),
                            p99_ms=harness.percentile(pl, 99), misses=sum(missed(x, period) for x in pl),
                            peak_mib=p.get("peak_mib"), busy_fraction=p.get("busy_fraction"),
                            busy_kernels=p.get("busy_kernels"), busy_clock=p.get("busy_clock"),
                            kernel_sum_fraction=p.get("kernel_sum_fraction"), warp_fill=p.get("warp_fill"),
                            sm_fill=p.get("sm_fill"),
                            busy_window=p.get("busy_window"), busy_error=p.get("busy_error")))
    peaks = [p.get("peak_mib") for p in parts]
    # per GPU: the processes sharing it pooled (their kernel intervals' union), one entry per GPU
    devices = device_busy(parts)
    busy = [d["busy_fraction"] for d in devices if d["busy_fraction"] is not None]
    return dict(cell=cell, name=cell, gpus=g, n_sessions=n, p50_ms=harness.percentile(lat, 50),
                p95_ms=harness.percentile(lat, 95), p99_ms=harness.percentile(lat, 99), max_ms=max(lat, default=None),
                misses=misses, chunks=len(lat) + abandoned, abandoned=abandoned,
                peak_mib=sum(peaks) if all(x is not None for x in peaks) else None,
                bitexact=exact, busy_fraction=sum(busy) / len(busy) if busy else None,
                busy_per_gpu=[d["busy_fraction"] for d in devices], per_device=devices,
                misses_while_profiling=profiled_misses,
                join_p50_ms=harness.percentile(join_ms, 50) if join_ms else None,
                join_max_ms=max(join_ms) if join_ms else None,
                join_window_misses=window_misses if any(j[1] >= 0 for j in joins) else None,
                per_gpu=per_gpu, session_sha={str(k): v for k, v in sorted(sha.items())})


def limits(rows: list[dict]) -> dict:
    """Per cell and GPU count: the largest N run without a miss (and exact), the smallest N with misses;
    and the ratio of the largest GPU count's limit to one GPU's. An N run more than once (``--pack``'s
    repeats) is clean only if every run of it is. Rows of another draw replay mode are a cell of their own
    (:func:`label`): one mode's misses say nothing of the other's limit."""
    out: dict = {}
    runs: dict = {}
    for r in rows:
        if "error" not in r:
            runs.setdefault((label(r), r["gpus"], r["n_sessions"]), []).append(r)
    for (cell, g, n), rs in runs.items():
        e = out.setdefault(cell, {}).setdefault(str(g), dict(largest_n_no_miss=None, smallest_n_with_misses=None))
        if all(r["misses"] == 0 and r["bitexact"] for r in rs):
            e["largest_n_no_miss"] = max(e["largest_n_no_miss"] or 0, n)
        elif any(r["misses"] for r in rs):
            m = e["smallest_n_with_misses"]
            e["smallest_n_with_misses"] = n if m is None else min(m, n)
    for per in out.values():
        one = (per.get("1") or {}).get("largest_n_no_miss")
        most = max((int(k) for k in per if k.isdigit()), default=1)
        top = per[str(most)]["largest_n_no_miss"]
        if most > 1 and one and top:
            per["ratio"] = dict(gpus=most, largest_over_one=top / one)
    return out


def progress(row: dict) -> str:
    """The line printed as a row comes."""
    if "error" in row:
        return f"[{row['cell']} gpus={row.get('gpus')} N={row.get('n_sessions')}] FAILED\n{row['error']}"
    return (f"[{label(row)} gpus={row['gpus']} N={row['n_sessions']}] p50 {row['p50_ms']:.0f} ms p99 "
            f"{row['p99_ms']:.0f} ms misses {row['misses']}/{row['chunks']} exact {row['bitexact']} peak "
            f"{fmt(row['peak_mib'], '.0f')} MiB busy {fmt(row.get('busy_fraction'), '.2f')} nvml "
            f"{fmt(row.get('nvml_util'), '.2f')} join p50/max {fmt(row.get('join_p50_ms'), '.1f')}/"
            f"{fmt(row.get('join_max_ms'), '.1f')} ms{fill_line(row)}{lock_line(row)}")


def label(row: dict) -> str:
    """The cell's name, with the draws' replay mode where it is not the default lock, and the worker
    processes per GPU where there are several (``/2p``; ``+mps`` under an MPS daemon)."""
    out = row["cell"]
    mode = row.get("draw_replay")
    if mode and mode != "lock":
        out += f"/{mode}"
    procs = row.get("procs_per_gpu") or 1
    if procs > 1:
        out += f"/{procs}p" + ("+mps" if row.get("mps") else "")
    return out


def lock_line(row: dict) -> str:
    """The draws' lock over the row, summed over its workers: seconds waited for it and held."""
    locks = [h["draw_lock"] for h in row.get("host") or [] if h and h.get("draw_lock")]
    if not locks:
        return ""
    return (f" draws' lock wait/held {sum(x['wait_s'] for x in locks):.1f}/{sum(x['held_s'] for x in locks):.1f} s"
            f" (longest {max(x['max_held_ms'] for x in locks):.0f} ms)")


def fill_line(row: dict) -> str:
    """Per GPU: kernels at once (summed kernel time over the union) and how full the kernels kept it."""
    out = []
    for p in row.get("per_device") or row.get("per_gpu") or []:
        b, k = p.get("busy_fraction"), p.get("kernel_sum_fraction")
        if b and k is not None:
            out.append(f" gpu {p['gpu']}: at once {k / b:.2f} warp fill {fmt(p.get('warp_fill'), '.2f')} "
                       f"sm fill {fmt(p.get('sm_fill'), '.2f')}")
    return ";".join(out)


def table(rows: list[dict]) -> str:
    head = (f"{'cell':<6}{'gpus':>5}{'N':>5}{'p50 ms':>9}{'p99 ms':>9}{'misses':>12}{'peak MiB':>10}{'busy':>6}"
            f"{'nvml':>6}{'join p50/max ms':>17}{'join-window misses':>20}{'exact':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['cell']:<6}{r.get('gpus')!s:>5}{r.get('n_sessions')!s:>5}  failed")
            continue
        join = f"{fmt(r.get('join_p50_ms'), '.1f')}/{fmt(r.get('join_max_ms'), '.1f')}"
        lines.append(f"{label(r):<6}{r['gpus']:>5}{r['n_sessions']:>5}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
                     f"{str(r['misses']) + '/' + str(r['chunks']):>12}{fmt(r['peak_mib'], '.0f'):>10}"
                     f"{fmt(r.get('busy_fraction'), '.2f'):>6}{fmt(r.get('nvml_util'), '.2f'):>6}{join:>17}"
                     f"{str(r.get('join_window_misses')):>20}{str(r['bitexact']):>7}")
    return "\n".join(lines)
