"""benchmarks/cadence.py --model moshi on the CPU, at reduced sizes: conversations through lanes are
each their script's solo stock stream.

In one process (no timing is asserted): the SRc worker's model (the three steps exported and optimized
with 2 lanes, ``benchmarks/cadence_moshi.py``) serves 3 conversations of 2 scripts through the cadence
worker's own serving loop (``benchmarks.cadence_worker.serve``: 2 threads, staggered arrivals); every
conversation's digest (every frame's tokens, then its PCM) must be its script's solo run through the
stock code, the vendor's process (the server's warm-up, then ``reset_streaming`` per conversation) and
the eager stock code from the built state alike. Sessions 0 and 2 follow one script beside different
neighbours, so equal bytes also show that a session's state and random streams are its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.upstream

FRAMES = 6  # the reduced LM ring holds 4 frames and Mimi's 3: every ring wraps
SCRIPTS = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cm():
    from cadence_fx.adapters import moshi as mo

    try:
        mo.load_moshi()
    except mo.UpstreamNotFound as e:
        pytest.skip(str(e))
    from benchmarks import cadence_moshi

    return cadence_moshi


def _args(**kw) -> argparse.Namespace:
    base = dict(model="moshi", reduced=True, lanes=2, worker=0, workers=0, branches=1, blas_streams=None, solo=None,
                solo_stock="vendor", busy_window=0.0)
    return argparse.Namespace(**{**base, **kw})


def _solo(cm, mode: str) -> dict[int, str]:
    from benchmarks.cadence_exact import solo_stock

    bench = cm.stock_bench(_args(solo="0,1", solo_stock=mode), "cpu")
    assert bench.step.mode == mode
    return {s: solo_stock(bench, s, FRAMES) for s in range(SCRIPTS)}


def test_conversations_on_lanes_are_each_their_solo_stock_stream(cm):
    from benchmarks.cadence_worker import serve

    args = _args()
    bench, conv, facts = cm.optimized_bench(args, "cpu")
    assert len(conv.lanes.lanes) == 2 and all(len(p.lanes.lanes) == 2 for p in conv.progs.values())
    assert set(facts["export_s"]) == set(cm.STAGES)
    n = 3
    cmd = dict(cmd="serve", n=n, sessions=list(range(n)), t0=time.time() + 0.1, period=0.05, chunks=FRAMES,
               scripts=SCRIPTS, join_live=False, busy_window=0.0)
    reply = serve(conv, bench, cmd, args, "cpu")
    assert sorted((r[0], r[1]) for r in reply["records"]) == [(i, k) for i in range(n) for k in range(FRAMES)]
    assert reply["per_session_mib"] > 0 and set(reply["counters"]) == set(cm.STAGES)
    eager, vendor = _solo(cm, "eager"), _solo(cm, "vendor")
    # the vendor's process (warm-up, then a reset per conversation) starts each one as the built state does
    assert vendor == eager and eager[0] != eager[1]
    assert {int(i): d for i, d in reply["sha"].items()} == {i: eager[i % SCRIPTS] for i in range(n)}


def test_frame_bytes_hash_as_the_frames_tensors(cm):
    from cadence_fx.determinism import sha256_tensors

    tokens = torch.arange(9, dtype=torch.long).view(1, 9, 1)
    pcm = torch.randn(1, 1, 1920)
    assert sha256_tensors([cm.frame_bytes(tokens, None), cm.frame_bytes(tokens, pcm)]) == sha256_tensors(
        [tokens, tokens, pcm])
