"""benchmarks/cadence.py --model code2wav on the CPU, at TINY sizes: conversations through lanes, and
conversations in stock processes, are each their script's solo stock stream; a wrong context is caught.

The process test runs the real layout (the coordinator, a solo process, an SRc worker with 2 lanes, a
stock row of one process per session) with 10-frame chunks, 3 frames of context and a 0.25 s period,
so that it takes seconds; no timing is asserted. The in-process test serves through the worker's own
loop (``benchmarks.cadence_worker.serve``) twice on one program: as the step's carry returns the
context, and with every carried context corrupted; the row's gate (``merge_row``'s ``bitexact``) must
pass the first and fail the second, so it is not vacuous: the context does reach every chunk's wav.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cadence  # noqa: E402
from benchmarks import cadence_code2wav as c2w_bench  # noqa: E402

pytestmark = pytest.mark.upstream

CHUNK, CONTEXT = 10, 3  # TINY sizes decode 10 + 3 frames per steady chunk
PERIOD, SECONDS = 0.25, 1.0  # 4 chunks per conversation: every chunk after the first reads a carried context
CHUNKS = round(SECONDS / PERIOD)
SCRIPTS = 2


def test_defaults_and_refusals():
    args = cadence.parser().parse_args(["--model", "code2wav", "--tiny"])
    c2w_bench.configure(args)
    assert args.reduced and (args.code2wav_chunk, args.code2wav_context) == (25, 24)
    assert args.period == pytest.approx(2.0)  # one chunk of audio: 25 frames at 12.5 frames/s
    for flags, words in ((["--dtype", "float16"], "float32 or bfloat16"),
                         (["--code2wav-context", "25"], "0 < context < chunk"),
                         (["--code2wav-chunk", "10", "--code2wav-context", "0"], "0 < context < chunk")):
        with pytest.raises(SystemExit, match=words):
            c2w_bench.configure(cadence.parser().parse_args(["--model", "code2wav", *flags]))


def test_sessions_through_lanes_and_stock_processes_are_their_solo_runs(tmp_path):
    out = tmp_path / "cadence.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cadence.py"), "--model", "code2wav", "--reduced",
           "--code2wav-chunk", str(CHUNK), "--code2wav-context", str(CONTEXT), "--cells", "SRc,stock", "--gpus", "1",
           "--sessions", "2", "--stock-sessions", "2", "--seconds", str(SECONDS), "--period", str(PERIOD),
           "--lanes", "2", "--scripts", str(SCRIPTS), "--warm-seconds", "0", "--lead", "0.7", "--json", str(out)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU layout, also on a GPU host
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["model"] == "code2wav" and rep["chunks_per_session"] == CHUNKS
    assert rep["setup"]["code2wav"]["chunk_frames"] == CHUNK and rep["setup"]["code2wav"]["sizes"] == "tiny"
    solo = rep["solo_sha"]
    assert set(solo) == {"0", "1"} and solo["0"] != solo["1"]  # the scripts' codes differ, so do their bytes
    rows = {r["cell"]: r for r in rep["rows"]}
    assert set(rows) == {"SRc", "stock"}
    for cell, r in rows.items():
        assert "error" not in r, r["error"]
        assert r["n_sessions"] == 2 and r["chunks"] == 2 * CHUNKS and r["abandoned"] == 0, cell
        assert r["bitexact"] is True, cell
        assert all(r["session_sha"][str(i)] == solo[str(i % SCRIPTS)] for i in range(2)), cell
    assert rows["stock"]["script_sha"] == {s: [solo[s]] for s in solo}


def test_a_corrupted_context_fails_the_gate():
    import torch

    import cadence_fx as cf
    from benchmarks.cadence_exact import solo_stock
    from benchmarks.cadence_model import build_bench
    from benchmarks.cadence_worker import build_program, serve

    args = argparse.Namespace(model="code2wav", reduced=True, dtype="float32", code2wav_chunk=CHUNK,
                              code2wav_context=CONTEXT, lanes=2, journal=False, artifact=None, worker=0, workers=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the benchmark's processes run one thread each on the CPU: the same reductions
    try:
        bench = build_bench(args, "cpu")
        solo = {s: solo_stock(bench, s, CHUNKS) for s in range(SCRIPTS)}
        prog, _export_s, _optimize_s = build_program(cf, bench, args, "auto")
        codebook = bench.step.model.config.codebook_size

        class WrongContext:
            """The step, but every context it carries is shifted by one code: still a valid context."""

            def __init__(self, step):
                self.step = step

            def __getattr__(self, name):
                return getattr(self.step, name)

            def carry(self, out):
                return {"ctx_codes": (out[1] + 1) % codebook}

        n = 3  # sessions 0 and 2 follow one script beside different neighbours
        rows = {}
        for name, b in (("honest", bench), ("corrupted", dataclasses.replace(bench, step=WrongContext(bench.step)))):
            cmd = dict(cmd="serve", n=n, sessions=list(range(n)), t0=time.time() + 0.1, period=0.05, chunks=CHUNKS,
                       scripts=SCRIPTS, join_live=False, busy_window=0.0)
            part = serve(prog, b, cmd, args, "cpu")
            assert len(part["records"]) == n * CHUNKS and part["abandoned"] == 0
            rows[name] = cadence.merge_row("SRc", 1, n, [part], solo, SCRIPTS, 0.05, CHUNKS)
    finally:
        torch.set_num_threads(threads)
    assert rows["honest"]["bitexact"] is True
    assert rows["corrupted"]["bitexact"] is False
    assert all(rows["corrupted"]["session_sha"][str(i)] != solo[i % SCRIPTS] for i in range(n))
