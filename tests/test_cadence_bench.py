"""benchmarks/cadence.py: placement on several GPUs, the shared t0, the merge of per-GPU parts, the gate.

The process test runs the real multi-process layout on the CPU: two "GPUs" are two worker processes
(each serves an untimed warm stream first; the one-GPU row of one N runs twice side by side on them,
``--pack``, and the stock cell's processes are pinned round robin to them), with the small demo decoder and a
0.5 s chunk period so that it takes seconds, not minutes. It checks what the coordinator builds from
what the processes send back, not any timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cadence  # noqa: E402


# --------------------------------------------------------------------------- pure pieces
def test_union_of_kernel_intervals_counts_overlaps_once():
    assert cadence.union_length([]) == 0
    assert cadence.union_length([(0, 10), (5, 15), (20, 30), (30, 31), (2, 3)]) == 26
    # two lanes fully overlapping: busy half the window, not all of it
    assert cadence.busy_fraction([(0, 50), (0, 50)], 100) == 0.5
    # queued work that runs past the window: the span is the denominator
    assert cadence.busy_fraction([(0, 150)], 100) == 1.0
    assert cadence.busy_fraction([], 100) == 0.0
    # clipped to the window [50, 150): what ran before or after it does not count
    assert cadence.busy_fraction([(0, 50), (90, 200), (100, 120)], 100, clip=(50, 150)) == 0.6


def test_fill_weighs_each_kernel_by_its_occupancy_and_grid_inside_the_window():
    from benchmarks.cadence_measure import fill_fractions, kernel_shape

    class Ev:  # a Kineto kernel event: its CUPTI record's members, without the braces
        def __init__(self, meta):
            self.meta = meta

        def metadata_json(self):
            return self.meta

    assert kernel_shape(Ev('"grid": [4, 1, 1], "blocks per SM": 0.5, "est. achieved occupancy %": 25')) == (0.25, 0.5)
    assert kernel_shape(Ev('"grid": [4, 1, 1]')) is None and kernel_shape(object()) is None
    # window [0, 100): a full-occupancy kernel over all SMs for 50, a quarter-occupancy half-grid one
    # for 40 (of which 20 inside), one without a record, one outside
    got = fill_fractions([(0, 50), (80, 120), (10, 20), (200, 300)],
                         [(1.0, 3.0), (0.25, 0.5), None, (1.0, 1.0)], (0, 100))
    assert got == dict(warp_fill=pytest.approx(0.55), sm_fill=pytest.approx(0.6), fill_kernels=2, fill_of=3)
    assert fill_fractions([(0, 10)], [None], (0, 100)) == dict(warp_fill=None, sm_fill=None)


def test_busy_window_starts_and_stops_in_its_thread_and_clips_on_wall_clock():
    """The window thread starts the profiler and, once the run is over, stops it (a profiler session
    belongs to its thread); the clip assumes the profiler's clock is ``time.time_ns``'s. On the CPU
    the window records host ops, of its own thread only, so what it measures here is the plumbing:
    no error, a window where it was asked for, a fraction in [0, 1] on the wall clock."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:  # the clock (and, on a GPU host, the main-thread init)
        before = time.time_ns()
        torch.randn(64, 64).sum()
        after = time.time_ns()
    starts = [ev.start_ns() for ev in p.profiler.kineto_results.events()]
    assert starts and all(before - 10**6 <= t <= after + 10**6 for t in starts), (before, starts, after)

    base = time.perf_counter()
    w = cadence.BusyWindow(base + 0.05, 0.2, device="cpu")
    w.start()
    while time.perf_counter() - base < 0.35:
        torch.randn(64, 64).sum()
    got = w.finish(base)
    assert got.get("busy_error") is None, got
    assert got["busy_clock"] == "wall" and 0.0 <= got["busy_fraction"] <= 1.0
    assert got["kernel_sum_fraction"] >= got["busy_fraction"]  # the sum counts overlaps, the union once
    assert got["warp_fill"] is None  # host ops have no CUPTI kernel record
    assert got["busy_window"][0] == pytest.approx(0.05, abs=0.1)
    assert not torch.autograd.profiler._is_profiler_enabled
    # a run that ends before its window opens: no window, no profiler left running
    late = cadence.BusyWindow(time.perf_counter() + 5, 1.0, device="cpu")
    late.start()
    assert late.finish(time.perf_counter())["busy_error"] == "the run ended before the window"


def test_timeline_slices_latency_by_arrival():
    records = [[0, k, float(k), k + 0.1] for k in range(10)] + [[1, k, 10.0 + k, 11.5 + k] for k in range(10)]
    got = cadence.timeline(records, 1.0)
    assert got == [[0.0, 100.0, 100.0, 0], [10.0, 1500.0, 1500.0, 10]]


def test_workers_get_more_hardware_queues_unless_told_not_to():
    assert cadence.worker_env({"A": "1"}, 32) == {"A": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert cadence.worker_env({"A": "1"}, 0) == {"A": "1"}


def test_session_lists_per_gpu_count():
    assert cadence.per_gpu_lists("16,17,18/32,34,36", [1, 2]) == {1: [16, 17, 18], 2: [32, 34, 36]}
    assert cadence.per_gpu_lists("16,18", [1, 2]) == {1: [16, 18], 2: [32, 36]}
    assert cadence.per_gpu_lists("32", [2]) == {2: [32]}
    assert cadence.per_gpu_lists("/2", [1, 2]) == {1: [], 2: [2]}
    with pytest.raises(SystemExit):
        cadence.per_gpu_lists("1/2/3", [1, 2])


def _demo_srcell(out, *extra):
    """Run the demo model's SRc cell on the CPU, 2 lanes, 0.5 s period, writing ``out``; fails the test
    with the tail of stderr when the benchmark does not exit cleanly."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cadence.py"), "--model", "demo", "--cells", "SRc",
           "--gpus", "1", "--warm-seconds", "0", "--period", "0.5", "--lanes", "2", "--scripts", "2",
           "--lead", "0.7", "--json", str(out), *extra]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _part(gpu, sessions, chunks, lat_s, sha, joins=(), peak=100.0, busy=None):
    recs = [[i, k, i * 0.1 + k, i * 0.1 + k + lat_s.get((i, k), 0.05)] for i in sessions for k in range(chunks)]
    return dict(gpu=gpu, records=recs, sha={str(i): sha[i] for i in sessions}, joins=list(joins), peak_mib=peak,
                busy_fraction=busy)


def test_merge_pools_every_gpu_and_gates_each_session_against_its_script():
    solo = {0: "a", 1: "b"}
    sha = {0: "a", 1: "b", 2: "a", 3: "b"}
    late = {(1, 2): 1.5, (2, 0): 1.2}  # session 1's chunk 2 (gpu 1), session 2's first chunk (gpu 0)
    # session 2 joins live at t=0.2 on gpu 0; session 0's chunk 1 arrives at 1.0, inside its second
    late[(0, 1)] = 2.0
    parts = [_part(0, [0, 2], 3, late, sha, joins=[[2, 0.2, 3.0]], peak=100.0, busy=0.5),
             _part(1, [1, 3], 3, late, sha, peak=120.0, busy=0.7)]
    row = cadence.merge_row("SRc", 2, 4, parts, solo, scripts=2, period=1.0, chunks=3)
    assert row["chunks"] == 12 and row["misses"] == 3 and row["bitexact"] is True
    assert row["peak_mib"] == 220.0 and row["busy_fraction"] == pytest.approx(0.6)
    assert [g["sessions"] for g in row["per_gpu"]] == [2, 2]
    assert [g["misses"] for g in row["per_gpu"]] == [2, 1]
    assert row["join_p50_ms"] == 3.0 and row["join_max_ms"] == 3.0
    assert row["join_window_misses"] == 1  # session 0's chunk 1; the joiner's own late chunk does not count
    # a wrong digest, or a missing chunk, is not exact
    bad = {**sha, 3: "x"}
    parts_bad = [_part(0, [0, 2], 3, {}, bad), _part(1, [1, 3], 3, {}, bad)]
    assert cadence.merge_row("SRc", 2, 4, parts_bad, solo, 2, 1.0, 3)["bitexact"] is False
    short = [_part(0, [0, 2], 3, {}, sha), _part(1, [1, 3], 2, {}, sha)]
    assert cadence.merge_row("SRc", 2, 4, short, solo, 2, 1.0, 3)["bitexact"] is False


def test_limits_and_ratio():
    rows = [dict(cell="SRc", gpus=1, n_sessions=n, misses=m, bitexact=True) for n, m in ((16, 0), (17, 0), (18, 4))]
    rows += [dict(cell="SRc", gpus=2, n_sessions=n, misses=m, bitexact=True) for n, m in ((32, 0), (34, 0), (36, 9))]
    lim = cadence.limits(rows)["SRc"]
    assert lim["1"] == dict(largest_n_no_miss=17, smallest_n_with_misses=18)
    assert lim["2"]["largest_n_no_miss"] == 34 and lim["ratio"]["largest_over_one"] == pytest.approx(2.0)
    # --pack's repeats: an N is clean only if every run of it is
    rows += [dict(cell="SRc", gpus=1, n_sessions=17, misses=2, bitexact=True)]
    assert cadence.limits(rows)["SRc"]["1"] == dict(largest_n_no_miss=16, smallest_n_with_misses=17)


def test_dtype_hook_fails_clearly_or_passes_through():
    assert cadence.dtype_hook("float32") == {}
    try:
        kw = cadence.dtype_hook("float16")
    except SystemExit as e:
        assert "float16" in str(e) and "build_step" in str(e)
    else:
        assert kw in ({"float16": True}, {"dtype": __import__("torch").float16})


def test_solo_digests_from_an_earlier_report_only_where_every_setting_fits(tmp_path):
    import argparse

    import torch

    args = argparse.Namespace(model="token2wav", dtype="float16", reduced=False, scripts=2, seconds=60.0, period=1.0,
                              warm_seconds=None)
    good = dict(model="token2wav", dtype="float16", reduced=False, chunks_per_session=60, torch=torch.__version__,
                device="NVIDIA H200", solo_sha={"0": "a", "1": "b"}, solo_gpu={"0": 0, "1": 1})
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(good))
    run = cadence.Run(args)
    run.adopt_solo(str(path))
    assert run.solo == {0: "a", 1: "b"} and run.solo_gpu == {0: 0, 1: 1}
    run.device = "NVIDIA H200"
    run.check_solo_device()
    run.device = "NVIDIA H100 80GB HBM3"
    with pytest.raises(SystemExit, match="H200.*H100"):
        run.check_solo_device()
    # before any worker reported (run.device unset): this host's card by NVML stops a wrong card at once
    run.device = None
    run.check_solo_device(None)  # no GPU name known yet: checked again once the workers report
    with pytest.raises(SystemExit, match="H200.*H100"):
        run.check_solo_device("NVIDIA H100 80GB HBM3")
    assert cadence.gpu_name([]) is None  # no GPU handed out: no name, no CUDA context opened
    for change, words in ((dict(dtype="float32"), "dtype"), (dict(chunks_per_session=30), "chunks_per_session"),
                          (dict(reduced=True), "reduced"), (dict(solo_sha={"0": "a"}), r"script\(s\) \[1\]")):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(SystemExit, match=words):
            cadence.Run(args).adopt_solo(str(path))


# --------------------------------------------------------------------------- the process layout
def test_two_fake_gpus_one_process_each(tmp_path):
    out = tmp_path / "cadence.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cadence.py"), "--model", "demo", "--cells", "SRc,stock",
           "--gpus", "1,2", "--sessions", "2/4", "--pack",
           "--warm-seconds", "0.5", "--stock-sessions", "/1,2", "--seconds", "1.5", "--period", "0.5",
           "--lanes", "2", "--scripts", "2", "--join-live", "--lead", "0.7", "--json", str(out),
           "--rows", str(tmp_path / "rows.jsonl")]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU layout, also on a GPU host
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    keys = [(r["cell"], r["gpus"], r["n_sessions"], r.get("repeat")) for r in rep["rows"]]
    assert keys == [("SRc", 1, 2, 0), ("SRc", 1, 2, 1), ("SRc", 2, 4, None), ("stock", 2, 1, None),
                    ("stock", 2, 2, None)], rep["rows"]
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 5
    # each stock row on processes of its own, as many as its sessions (none idle beside it)
    assert [(p["gpus"], p["processes"]) for p in rep["setup"]["stock"]] == [(2, 1), (2, 2)]
    # --pack: only rows of one N side by side: N=2 on each worker at once, two independent one-GPU rows
    one = [r for r in rep["rows"] if r["gpus"] == 1]
    assert [r["gpu_ids"] for r in one] == [[0], [1]] and [r["concurrent_n"] for r in one] == [[2], [2]]
    rows = {(r["cell"], r["gpus"], r["n_sessions"]): r for r in rep["rows"][1:]}
    assert rows[("SRc", 2, 4)]["gpu_ids"] == [0, 1] and rows[("SRc", 2, 4)]["concurrent_n"] is None
    # the warm stream: every worker, once, before any row, at the first N it serves (N=2, alone); not a row
    warm = rep["setup"]["SRc"]["warm"]
    assert rep["warm_s"] == 0.5 and warm["chunks_per_session"] == 1
    assert [(w["gpu"], w["n_sessions"], w["gpus"], w["sessions"], w["chunks"]) for w in warm["per_worker"]] == [
        (0, 2, 1, 2, 2), (1, 2, 1, 2, 2)]
    assert rep["chunks_per_session"] == 3 and set(rep["solo_sha"]) == {"0", "1"}
    for (cell, g, n), r in rows.items():
        assert "error" not in r
        assert r["bitexact"] is True, (cell, g, n)
        assert r["chunks"] == n * 3
        # sessions placed round robin: gpu j serves sessions j, j+g, ...; every session's bytes are its script's
        assert [p["sessions"] for p in r["per_gpu"]] == [len(range(j, n, g)) for j in range(g)]
        assert sum(p["chunks"] for p in r["per_gpu"]) == r["chunks"]
        assert all(r["session_sha"][str(i)] == rep["solo_sha"][str(i % 2)] for i in range(n))
    # per worker: the host's share (CPU per wall second, call times) and latency by arrival slice
    host = rows[("SRc", 2, 4)]["host"]
    assert len(host) == 2 and all(h["cpu_per_wall"] > 0 and h["call_p50_ms"] > 0 for h in host)
    assert all(h["threads_on_lane_streams"] == 0 for h in host)
    assert all(sum(w[3] for w in h["timeline"]) <= rows[("SRc", 2, 4)]["misses"] for h in host)
    # the live joins were measured in the SRc rows, one per session
    assert rows[("SRc", 2, 4)]["join_max_ms"] is not None and rows[("SRc", 2, 4)]["join_window_misses"] is not None
    assert rows[("stock", 2, 2)]["script_sha"] == {"0": [rep["solo_sha"]["0"]], "1": [rep["solo_sha"]["1"]]}
    assert set(rep["limits"]["SRc"]) >= {"1", "2"}


def test_plot_series_one_line_per_cell_gpu_count_and_lanes():
    from benchmarks import plot_cadence

    rows = [dict(name="SRc", n_sessions=16, p50_ms=80, p99_ms=90, misses=0),  # before multi-GPU: one GPU
            dict(cell="SRc", gpus=2, n_sessions=34, p50_ms=85, p99_ms=95, misses=0, bitexact=True),
            dict(cell="SRc", gpus=2, n_sessions=32, p50_ms=80, p99_ms=90, misses=0, bitexact=True),
            dict(cell="stock", gpus=1, n_sessions=12, p50_ms=300, p99_ms=700, misses=0),
            dict(cell="SRc", gpus=1, lanes=8, n_sessions=36, p50_ms=120, p99_ms=150, misses=0, bitexact=True),
            dict(cell="stock", gpus=1, n_sessions=14, error="boom")]
    got = plot_cadence.series(rows)
    assert list(got) == [("SRc", 1, None), ("SRc", 1, 8), ("SRc", 2, None), ("stock", 1, None)]
    assert [p[0] for p in got[("SRc", 2, None)]] == [32, 34]


def test_a_row_slower_than_real_time_is_cut_and_its_unserved_chunks_are_misses(tmp_path):
    """``--row-slack``: a row still running past its last deadline plus the slack stops; the chunks it
    never served are counted as misses (``abandoned``) and its exactness is not judged (its streams are
    incomplete). A negative slack cuts this fast row on purpose: chunk 2 of each session is due at
    1.0 s or later, after the 0.8 s cut-off."""
    from benchmarks.cadence_run import row_cutoff_s

    assert row_cutoff_s(0.5, 3, 10.0) == 12.0  # one period past the last arrival, then the slack
    out = tmp_path / "cadence.json"
    _demo_srcell(out, "--sessions", "2", "--seconds", "1.5", "--row-slack", "-1.2")
    (row,) = json.loads(out.read_text())["rows"]
    assert row["abandoned"] >= 2 and row["chunks"] == 2 * 3  # every chunk is counted, served or not
    assert row["misses"] >= row["abandoned"] and row["bitexact"] is None
    assert json.loads(out.read_text())["limits"]["SRc"]["1"]["largest_n_no_miss"] is None


def test_draw_replay_modes_run_in_order_at_every_n_and_unknown_ones_are_refused(tmp_path):
    """``--draw-replay lock,lockless``: each N runs a row per mode, in that order, on the same workers,
    each row saying its mode and each exact; a mode that is not one is refused before anything starts."""
    from benchmarks.cadence_run import draw_replay_modes

    assert draw_replay_modes("lock, lockless") == ["lock", "lockless"]
    with pytest.raises(SystemExit, match="lockless"):
        draw_replay_modes("lock,nolock")
    out = tmp_path / "cadence.json"
    proc = _demo_srcell(out, "--sessions", "2,3", "--seconds", "1.0", "--draw-replay", "lock,lockless")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n_sessions"], r["draw_replay"]) for r in rows] == [
        (2, "lock"), (2, "lockless"), (3, "lock"), (3, "lockless")]
    assert all(r["bitexact"] is True for r in rows)
    assert "SRc/lockless gpus=1 N=3" in proc.stderr
    # each mode's limit is its own: a miss in one mode does not hide the other's largest clean N
    assert set(json.loads(out.read_text())["limits"]) == {"SRc", "SRc/lockless"}


def test_processes_sharing_a_gpu_split_its_sessions_and_pool_into_one_row(tmp_path):
    """``--procs-per-gpu 2``: two worker processes on the one (CPU) "GPU", each serving every other
    session; the row pools both (every session exact, each served by one process), is labelled with
    the process count, and ``--mps`` without a GPU says why no daemon ran instead of failing."""
    out = tmp_path / "cadence.json"
    proc = _demo_srcell(out, "--sessions", "3", "--seconds", "1.0", "--procs-per-gpu", "2", "--mps")
    rep = json.loads(out.read_text())
    (row,) = rep["rows"]
    assert row["procs_per_gpu"] == 2 and row["mps"] is False and row["bitexact"] is True
    assert [(p["gpu"], p["slot"], p["sessions"]) for p in row["per_gpu"]] == [(0, 0, 2), (0, 1, 1)]
    assert row["chunks"] == 3 * 2 and row["gpu_ids"] == [0]
    assert [d["processes"] for d in row["per_device"]] == [2]
    assert "SRc/2p gpus=1 N=3" in proc.stderr and set(rep["limits"]) == {"SRc/2p"}
    assert rep["setup"]["mps"]["running"] is False and "no GPU" in rep["setup"]["mps"]["error"]
    assert sorted(r["slot"] for r in rep["setup"]["SRc"]["workers"]) == [0, 1]


def test_processes_sharing_a_gpu_need_their_own_rows_not_pack(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cadence.py"), "--model", "demo", "--cells", "SRc",
           "--procs-per-gpu", "2", "--pack", "--json", str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode != 0 and "--pack" in proc.stderr and not (tmp_path / "x.json").exists()


def test_a_gpu_shared_by_processes_is_busy_where_any_of_them_runs_a_kernel():
    from benchmarks.cadence_measure import device_busy

    a = dict(gpu=0, busy_fraction=0.5, kernel_sum_fraction=0.6, warp_fill=0.2, sm_fill=0.3,
             busy_union=[[0, 40], [60, 100]], busy_clip=[0, 100])
    b = dict(gpu=0, busy_fraction=0.3, kernel_sum_fraction=0.3, warp_fill=0.1, sm_fill=None,
             busy_union=[[30, 70]], busy_clip=[10, 110])
    c = dict(gpu=1, busy_fraction=0.9, kernel_sum_fraction=2.0, warp_fill=0.5, sm_fill=0.5)
    d0, d1 = device_busy([a, b, c])
    # common span [10, 100): a's [10,40) + [60,100) and b's [30,70) cover all 90 ns of it
    assert d0["processes"] == 2 and d0["busy_fraction"] == pytest.approx(1.0)
    assert d0["kernel_sum_fraction"] == pytest.approx(0.9) and d0["warp_fill"] == pytest.approx(0.3)
    assert d0["sm_fill"] is None  # one process without the figure: no pooled figure
    assert d1 == dict(gpu=1, processes=1, busy_fraction=0.9, kernel_sum_fraction=2.0, warp_fill=0.5, sm_fill=0.5)
    b2 = dict(b, busy_union=[[45, 50]])
    assert device_busy([a, b2])[0]["busy_fraction"] == pytest.approx((30 + 5 + 40) / 90)
    # a process whose window failed: the GPU's busy figure is unknown, not the other process's alone
    assert device_busy([a, dict(gpu=0, busy_fraction=None)])[0]["busy_fraction"] is None


def test_the_other_processes_of_a_gpu_start_from_the_artifact_slot_0_saved(tmp_path):
    """``--artifact`` not yet saved with ``--procs-per-gpu 2``: slot 0 exports, optimizes and saves it;
    slot 1 starts after slot 0 is ready and loads it; both serve exact streams."""
    out, art = tmp_path / "cadence.json", tmp_path / "demo.cfx"
    _demo_srcell(out, "--sessions", "2", "--seconds", "1.0", "--procs-per-gpu", "2", "--artifact", str(art))
    rep = json.loads(out.read_text())
    workers = {w["slot"]: w for w in rep["setup"]["SRc"]["workers"]}
    assert workers[0]["load_s"] is None and workers[0]["optimize_s"] > 0
    assert workers[1]["load_s"] is not None and workers[1]["optimize_s"] == 0.0
    assert art.exists() and rep["rows"][0]["bitexact"] is True


def test_share_weights_only_where_it_can_work():
    import argparse

    ok = dict(share_weights=True, model="moshi", procs_per_gpu=2)
    cadence.check_share_weights(argparse.Namespace(**ok), ["0"])
    cadence.check_share_weights(argparse.Namespace(**{**ok, "share_weights": False, "model": "token2wav"}), [])
    for change, visible, words in ((dict(model="token2wav"), ["0"], "moshi only"),
                                   (dict(procs_per_gpu=1), ["0"], "procs-per-gpu"), ({}, [], "needs GPUs")):
        with pytest.raises(SystemExit, match=words):
            cadence.check_share_weights(argparse.Namespace(**{**ok, **change}), visible)
    args = argparse.Namespace(model="moshi", dtype="float32", reduced=True, scripts=2, seconds=1.0, period=0.08,
                              warm_seconds=None)
    run = cadence.Run(args)
    assert run.share_dir() == run.share_dir() and os.path.isdir(run.share_dir())
    assert run.meta["share_weights"]["dir"] == run.share_dir()


def test_shared_weight_workers_build_one_at_a_time_and_wait_for_each_other(tmp_path):
    """``--share-weights``' build turns (threads stand in for a GPU's worker processes): slot 0 builds
    first, no two builds overlap, and no worker goes on before every slot has built; a slot that never
    builds stops the others with its number instead of a hang."""
    import argparse
    import threading
    import time

    from benchmarks import cadence_moshi as cm

    events: list[tuple[str, int]] = []

    def worker(slot: int) -> None:
        a = argparse.Namespace(slot=slot, worker=0, share_weights_dir=str(tmp_path), share_weights_slots=3)
        with cm._build_turn(a, wait_s=30):
            events.append(("build", slot))
            time.sleep(0.2)
            if slot == 0:
                Path(cm._publication_path(a)).write_text(json.dumps({"format": "cadence_fx.process_weights/1",
                                                                     "entries": {}}))
            events.append(("built", slot))
        events.append(("on", slot))

    threads = [threading.Thread(target=worker, args=(s,)) for s in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    builds = [e for e in events if e[0] in ("build", "built")]
    assert builds[:2] == [("build", 0), ("built", 0)]
    assert all(builds[i][0] == "build" and builds[i + 1] == ("built", builds[i][1]) for i in range(0, 6, 2))
    assert all(e[0] == "on" for e in events[6:]) and len(events) == 9
    lone = argparse.Namespace(slot=0, worker=1, share_weights_dir=str(tmp_path), share_weights_slots=2)
    with pytest.raises(SystemExit, match=r"slot\(s\) \[1\] of gpu 1"):
        with cm._build_turn(lone, wait_s=0.3):
            pass


def test_a_worker_that_dies_starting_reports_its_traceback_and_the_gpus_memory(monkeypatch):
    """A worker process that exits before replying raises with its stderr's tail and, where NVML
    answers, who held the GPU's memory (an allocation failure below the total names the holders)."""
    from benchmarks import cadence_worker

    monkeypatch.setattr(cadence_worker, "gpu_memory_line", lambda gpu: f"gpu {gpu} memory (NVML): test\n")
    w = cadence_worker.Worker(3, [sys.executable, "-c", "import sys; sys.stderr.write('boom at build\\n'); sys.exit(2)"],
                              dict(os.environ, CUDA_VISIBLE_DEVICES="5"), slot=1)
    with pytest.raises(RuntimeError) as e:
        w.receive()
    msg = str(e.value)
    assert msg.startswith("worker on gpu 3.1 exited (rc 2):")
    assert "boom at build" in msg and msg.endswith("gpu 5 memory (NVML): test\n")


def test_gpu_memory_line_is_empty_where_nvml_cannot_answer():
    from benchmarks.cadence_measure import gpu_memory_line

    line = gpu_memory_line("no-such-gpu")
    assert line == "" or line.startswith("gpu no-such-gpu memory (NVML): ")


def test_mps_workers_of_a_gpu_ask_for_no_more_connections_than_the_pool_serves(monkeypatch):
    """Under MPS a GPU's clients share one pool of work queues and a client the pool cannot serve fails
    its first CUDA call (session 34: three clients of 32 started, a fourth did not; six of 16 did).
    ``client_connections`` caps each worker's ``CUDA_DEVICE_MAX_CONNECTIONS`` to its share; the run
    records what the workers got, in the row and in ``setup.mps``; without MPS the request stands."""
    from benchmarks import cadence_mps, cadence_run

    cc = cadence_mps.client_connections
    assert cc(32, 3) == 32 and cc(32, 4) == 24 and cc(16, 6) == 16 and cc(32, 16) == 6 and cc(32, 500) == 1
    assert cc(0, 2) == 8 and cc(0, 16) == 6  # 0: the driver's 8, capped as well
    with pytest.raises(ValueError, match="0 clients"):
        cc(32, 0)

    class Daemon:  # a daemon that started (no GPU here): what the run reads of one
        def __init__(self):
            self.running, self.facts = False, {"requested": True}

        def start(self, _visible):
            self.running = True
            self.facts.update(running=True)

        def env(self, base):
            return dict(base, CUDA_MPS_PIPE_DIRECTORY="/nowhere")

    envs = []

    class FakeWorker:
        def __init__(self, g, cmd, env, slot=0):
            envs.append((slot, env))

    monkeypatch.setattr(cadence_run, "MpsDaemon", Daemon)
    monkeypatch.setattr(cadence_run, "Worker", FakeWorker)
    for mps, procs, want in ((True, 4, "24"), (True, 2, "32"), (False, 4, "32")):
        envs.clear()
        args = cadence.parser().parse_args(["--model", "demo", "--period", "1.0", "--procs-per-gpu", str(procs)] + (["--mps"] if mps else []))
        run = cadence.Run(args)
        run.start_workers(1)
        assert sorted(s for s, _ in envs) == list(range(procs))
        assert {e["CUDA_DEVICE_MAX_CONNECTIONS"] for _, e in envs} == {want}
        assert run.connections == int(want)
        if mps:
            assert run.meta["mps"]["connections"] == int(want)
            assert all(e["CUDA_MPS_PIPE_DIRECTORY"] == "/nowhere" for _, e in envs)
