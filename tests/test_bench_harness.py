"""The benchmark harness's pure parts: the exactness gate across lanes and runs, the split of a
profiled call's device timeline, and the every-cell plot (no GPU needed)."""

from __future__ import annotations

import json
import math
import sys

import torch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks import harness  # noqa: E402


def _row(name, sha, p50, *, run=0, lane=0, block=0, **kw):
    return dict(name=name, sha256=sha, p50_ms=p50, p95_ms=p50, run=run, lane=lane, block=block, **kw)


def test_a_lane_without_baseline_is_gated_against_its_own_runs_baseline_first():
    rows = [_row("B0", "old", 400.0, run=0), _row("B0", "new", 300.0, run=1, lane=0),
            _row("SRc", "new", 60.0, run=1, lane=1), _row("SR", "old", 60.0, run=1, lane=1, block=0)]
    gated = {(r["name"], r["run"]): r for r in harness.gate(rows)}
    assert gated[("SRc", 1)]["bitexact"] is True
    assert gated[("SRc", 1)]["speedup"] == 300.0 / 60.0  # run 1's B0, not run 0's
    assert gated[("SR", 1)]["bitexact"] is False and gated[("SR", 1)]["speedup"] is None


def test_a_run_without_any_baseline_falls_back_to_another_runs():
    rows = [_row("B0", "x", 200.0, run=0), _row("S", "x", 100.0, run=1), _row("S", "y", 100.0, run=1, block=1)]
    gated = harness.gate(rows)
    assert [r["bitexact"] for r in gated if r["name"] == "S"] == [True, None]  # block 1 has no baseline at all: not judged


def test_a_cell_listed_before_its_runs_baseline_still_gets_its_speedup():
    # two processes of one device call, their rows concatenated cell by cell: the cell comes first
    rows = harness.gate([_row("SRcn", "x", 90.0, run=0, baseline="B0n"), _row("B0n", "x", 450.0, run=0, baseline="B0n")])
    summary = harness.summarize(rows)
    assert list(summary) == ["SRcn", "B0n"]  # the report keeps the rows' order
    assert summary["SRcn"]["speedup"] == 450.0 / 90.0


def test_device_gaps_split_node_switches_from_host_waits():
    # kernels in µs: two back to back, a 2 µs switch, an overlap, then a 50 µs wait for the host
    ivs = [(10.0, 20.0), (20.0, 30.0), (32.0, 40.0), (35.0, 45.0), (95.0, 100.0)]
    g = harness.device_gaps(ivs, host_start=4.0)
    assert math.isclose(g["span_ms"], 0.090)
    assert math.isclose(g["short_gaps_ms"], 0.002)
    assert math.isclose(g["host_gaps_ms"], 0.050)
    assert math.isclose(g["lead_ms"], 0.006)
    assert math.isnan(harness.device_gaps(ivs)["lead_ms"])


def test_plot_every_cell_gathers_each_cell_of_each_run(tmp_path):
    from benchmarks import plot_token2wav

    cells = [_row("B0", "a", 300.0, peak_mib=3766.0, bitexact=True),
             _row("SRc", "a", 63.0, peak_mib=1673.0, bitexact=True),
             _row("compile", "b", 90.0, peak_mib=3765.0, bitexact=False),
             _row("B0h", "c", 400.0, run=1, peak_mib=1962.0, bitexact=True, baseline="B0h"),
             _row("SRch", "c", 43.0, run=1, peak_mib=996.0, bitexact=True, baseline="B0h"),
             dict(name="S", run=1, block=0, error="cut by the slot")]
    src = tmp_path / "report.json"
    src.write_text(json.dumps(dict(gpu="test GPU", torch="x", date="d", cells=cells)))
    entries = plot_token2wav._cells(json.loads(src.read_text()))
    assert [(e["name"], e["run"]) for e in entries] == [("B0", 0), ("compile", 0), ("SRc", 0), ("B0h", 1), ("SRch", 1)]
    assert [e["exact"] for e in entries] == [True, False, True, True, True]
    assert [e["baseline"] for e in entries] == ["B0", "B0", "B0", "B0h", "B0h"]


def test_host_copy_of_a_strided_view_is_its_contiguous_copy():
    """The Moshi probe's host copy (slab by slab, no device temporary) gives the bytes ``.contiguous()``
    gives, so the per-frame digests are those of earlier runs."""
    from benchmarks.moshi import host_copy

    ring = torch.arange(2 * 1 * 3 * 7 * 4, dtype=torch.float32).reshape(2, 1, 3, 7, 4)
    for view in (ring.narrow(3, 0, 5), ring.narrow(3, 2, 0), ring, ring.transpose(3, 4), ring[:, :, 1:]):
        got = host_copy(view)
        assert got.is_contiguous() and torch.equal(got, view.contiguous())
        assert got.untyped_storage().data_ptr() != ring.untyped_storage().data_ptr()


def test_moshi_stage_gaps_split_each_stage_at_its_host_range():
    """The Moshi profile's per-stage split: device work is assigned to the stage whose host range it starts
    in; lead, node switches (< 5 µs) and waits for the host (longer) are counted within the stage only."""
    from benchmarks.moshi import stage_gaps

    device = [(110.0, 120.0), (122.0, 130.0), (150.0, 160.0),   # encode: lead 10, a 2 µs switch, a 20 µs wait
              (205.0, 215.0), (216.0, 220.0)]                   # lm: lead 5, a 1 µs switch
    got = stage_gaps(device, {"encode": (100.0, 170.0), "lm": (200.0, 230.0), "decode": (240.0, 250.0)})
    enc, lm = got["encode"], got["lm"]
    assert math.isclose(enc["lead_ms"], 0.010) and math.isclose(enc["short_gaps_ms"], 0.002)
    assert math.isclose(enc["host_gaps_ms"], 0.020) and math.isclose(enc["span_ms"], 0.050)
    assert math.isclose(lm["lead_ms"], 0.005) and math.isclose(lm["short_gaps_ms"], 0.001)
    assert lm["host_gaps_ms"] == 0 and math.isclose(lm["wall_ms"], 0.030)
    assert got["decode"] == {"wall_ms": 0.010}  # no device work in its range


def test_profile_events_walks_launches_kernels_copies_and_ranges_once():
    """The one walk both profilers share: copies are device time but not kernels, launches are counted by
    API name, host ranges are found by prefix (their device-side annotations are not device work), and the
    first host event starts the lead."""
    from types import SimpleNamespace as NS

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, dev, start, end):
        return NS(name=name, device_type=dev, time_range=NS(start=start, end=end, elapsed_us=lambda: end - start))

    prof = NS(events=lambda: [ev("stage:lm", cpu, 5.0, 90.0), ev("cudaGraphLaunch", cpu, 10.0, 12.0),
                              ev("gemm", cuda, 20.0, 30.0), ev("gemm", cuda, 31.0, 41.0),
                              ev("Memcpy HtoD", cuda, 42.0, 50.0), ev("other", cpu, 2.0, 3.0),
                              # the range's mirror on the device timeline (a gpu_user_annotation): not work
                              ev("stage:lm", cuda, 19.0, 51.0)])
    got = harness.profile_events(prof, range_prefix="stage:")
    assert got["launches"] == 1 and dict(got["kernel_names"]) == {"gemm": 2}
    assert math.isclose(got["busy_ms"], 0.020) and len(got["device"]) == 3
    assert got["ranges"] == {"lm": (5.0, 90.0)} and got["host_start"] == 2.0


def test_library_warnings_keeps_what_cadence_fx_logs_for_the_cell_row():
    """A refused capture's error reaches the cell's row (the cell's process is gone when the report is
    printed): cadence_fx's warnings are kept, cut and counted; other loggers' are not."""
    import logging

    logger = logging.getLogger("cadence_fx")
    handlers, level = list(logger.handlers), logger.level
    try:
        kept = harness.library_warnings(limit=2, width=12)
        for i in range(3):
            logging.getLogger("cadence_fx.replay").warning("L__self__: eager (capture_failed) %d", i)
        logging.getLogger("elsewhere").warning("not ours")
        logging.getLogger("cadence_fx.replay").info("not a warning")
        assert kept == ["L__self__: e", "L__self__: e"]
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
