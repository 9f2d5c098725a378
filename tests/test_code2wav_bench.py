"""benchmarks/code2wav.py and cadence_fx.adapters.code2wav at tiny sizes: the adapter's step streams
exactly what ``chunked_decode`` returns, the graph wrappers pick vLLM-Omni's buckets (or the stream's own
lengths) and cut padded outputs to the model's length, and the benchmark runs end to end on the CPU (its
CUDA-only cells skipped, stock and cadence bytes equal). On a GPU the same run takes the graph cells too
(``cuda``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import code2wav as bench  # noqa: E402
from benchmarks.code2wav_buckets import VLLM_OMNI_BUCKETS, BucketGraphs  # noqa: E402
from cadence_fx.adapters import code2wav as c2w  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return c2w.build(c2w.config(c2w.TINY))


def test_released_config_is_transformers_default():
    """The hardcoded released numbers are those of ``Qwen3OmniMoeCode2WavConfig()`` (the checkpoint's)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    default, ours = Qwen3OmniMoeCode2WavConfig().to_dict(), c2w.config().to_dict()
    assert {k: ours[k] for k in c2w.RELEASED} == {k: default[k] for k in c2w.RELEASED}


@pytest.mark.parametrize("chunk,left,chunks", [(10, 3, 12), (8, 4, 5), (5, 4, 7)])
def test_step_stream_is_chunked_decode(tiny, chunk, left, chunks):
    step, _contract, example = c2w.bind(tiny, chunk, left)
    codes = c2w.stream_codes(tiny, chunks, chunk, seed=chunk)
    with torch.no_grad():
        want = tiny.chunked_decode(codes, chunk, left)
        ctx, got = example["ctx_codes"], []
        for k in range(chunks):
            wav, ctx = step(ctx, codes[..., k * chunk:(k + 1) * chunk].clone())
            got.append(wav)
            assert ctx.shape[-1] == left
    assert torch.equal(torch.cat(got, -1), want)
    # each chunk keeps fewer samples than frames x upsampling: the decoder's transposed convolutions trim
    assert want.shape[-1] == chunks * (c2w.output_samples(tiny, chunk + left) - left * int(tiny.total_upsample))


def test_output_samples_is_the_models_length(tiny):
    with torch.no_grad():
        for frames in (1, 2, 13, 40):
            assert tiny(torch.zeros(1, 4, frames, dtype=torch.long)).shape[-1] == c2w.output_samples(tiny, frames)
    assert c2w.output_samples(type("M", (), {"config": c2w.config()})(), 300) == 300 * 1920 - 555


def test_contract_catalog_and_refusal():
    import cadence_fx as cf

    assert cf.call_classes(c2w.code2wav_contract()) == [{"ctx": 0}, {"ctx": 25}]
    with pytest.raises(ValueError, match="left_context_size < chunk_size"):
        c2w.code2wav_contract(10, 10)


def test_buckets_and_windows(tiny):
    # chunked_decode's windows at its defaults: 300 frames first, then 325 with the context
    assert bench.windows(3, 300, 25) == [(0, 300), (25, 325), (25, 325)]
    graphs = BucketGraphs(tiny, VLLM_OMNI_BUCKETS)
    assert [graphs.bucket_for(n) for n in (1, 64, 65, 300, 325, 500, 501)] == [64, 64, 100, 300, 400, 500, None]
    exact = BucketGraphs(tiny, [300, 325], pad=False)
    assert [exact.bucket_for(n) for n in (299, 300, 325, 326)] == [None, 300, 325, None]
    with pytest.raises(ValueError):
        BucketGraphs(tiny, cut="nowhere")


class _ReplayOnTheHost:
    """A captured "graph" on the CPU: replay reruns the eager forward on the static input into the static output."""

    def __init__(self, fn, static_in):
        self.fn, self.static_in = fn, static_in
        self.static_out = fn(static_in)

    def replay(self):
        self.static_out.copy_(self.fn(self.static_in))


def test_padded_buckets_keep_the_length_not_the_bits(tiny):
    """The wrapper's padding and cut, with host "graphs": the stream has eager's length and values to
    rounding; whether its bytes equal eager's is what the GPU cell measures (on this CPU they differ by
    about 1e-11: a padded shape is another reduction order)."""
    graphs = BucketGraphs(tiny, [16])
    codes = c2w.stream_codes(tiny, 12, 10)
    with torch.no_grad():
        fake = _ReplayOnTheHost(graphs.eager, torch.zeros(1, 4, 16, dtype=torch.long))
        graphs.graphs[16], graphs.static_in[16], graphs.static_out[16] = fake, fake.static_in, fake.static_out
        want = tiny.chunked_decode(codes, 10, 3)
        with graphs.installed():
            got = tiny.chunked_decode(codes, 10, 3)
        frames_cut = BucketGraphs(tiny, [16], cut="frames")
        for attr in ("graphs", "static_in", "static_out"):
            setattr(frames_cut, attr, getattr(graphs, attr))
        with frames_cut.installed():
            longer = tiny.chunked_decode(codes, 10, 3)
    assert "forward" not in vars(tiny)  # the stock forward is back
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    pad = graphs.padding()
    assert pad["paths"] == {"padded": 12} and pad["padded_frames"] == 6 + 11 * 3
    assert pad["frames_cut_extra_samples"] == [9]
    assert longer.shape[-1] == want.shape[-1] + 12 * 9  # a cut at frames x 12 keeps 9 samples more per chunk here


def test_cell_names():
    assert bench.parse_cell("cadence") == ("cadence", torch.float32, "stock")
    assert bench.parse_cell("buckets_bf16") == ("buckets", torch.bfloat16, "stock_bf16")
    with pytest.raises(SystemExit):
        bench.parse_cell("compile")


def _run(tmp_path: Path, cells: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    out = tmp_path / "code2wav.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "code2wav.py"), "--tiny", "--chunks", "12", "--cells", cells,
           "--json", str(out), "--rows", str(tmp_path / "rows.jsonl"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)


def _check_report(doc: dict, names: set[str]) -> dict:
    for key in ("model", "sizes", "gpu", "torch", "transformers", "envelope", "chunks", "chunk_size",
                "left_context_size", "cells", "skipped", "summary", "exact"):
        assert key in doc, key
    assert doc["chunk_size"] == 10 and doc["left_context_size"] == 3 and doc["chunks"] == 12
    by = {r["name"]: r for r in doc["cells"]}
    assert set(by) == names, [r.get("error") for r in doc["cells"]]
    for r in by.values():
        assert "error" not in r, r["error"]
        for key in ("p50_ms", "p95_ms", "p99_ms", "ms", "peak_mib", "sha256", "chunk_sha", "samples", "bitexact",
                    "baseline", "dtype", "total_ms"):
            assert key in r, (r["name"], key)
        assert len(r["ms"]) == len(r["chunk_sha"]) == 12
    stock, cadence = by["stock"], by["cadence"]
    assert stock["pieces_equal_return"] and stock["speedup"] == 1.0
    assert cadence["sha256"] == stock["sha256"] and cadence["bitexact"] and cadence["chunks_match_stock"] == 12
    assert cadence["inprocess"]["all_equal"] and cadence["inprocess"]["max_abs_diff"] == 0.0
    assert cadence["classes"] == [{"ctx": 0}, {"ctx": 3}]
    for key in ("export_s", "optimize_s", "warmup_s", "counters", "memory", "traffic"):
        assert key in cadence, key
    return by


def test_benchmark_runs_on_the_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU layout (the GPU one is test_benchmark_runs_on_the_gpu)")
    proc = _run(tmp_path, "stock,buckets,exact,cadence", "--cpu-replay", "fake")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "code2wav.json").read_text())
    by = _check_report(doc, {"stock", "cadence"})
    assert doc["skipped"] == [{"name": n, "reason": "needs CUDA (CUDA graphs)"} for n in ("buckets", "exact")]
    assert by["cadence"]["replay"] == "FakeBackend" and by["cadence"]["counters"]["replays"] == 12
    assert "buckets" in proc.stdout and "skipped" in proc.stdout  # the table says so
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in rows) == ["cadence", "stock"]


def test_missing_transformers_says_what_to_install(tmp_path):
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('transformers is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = _run(tmp_path, "stock", env=env)
    assert proc.returncode != 0
    assert "needs transformers 5.24" in proc.stderr and ".whl/" in proc.stderr, proc.stderr


@pytest.mark.cuda
def test_benchmark_runs_on_the_gpu(tmp_path):
    proc = _run(tmp_path, "stock,buckets,exact,cadence")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by = _check_report(json.loads((tmp_path / "code2wav.json").read_text()), {"stock", "buckets", "exact", "cadence"})
    for name, paths in (("buckets", {"padded": 12}), ("exact", {"exact": 12})):
        b = by[name]
        assert b["buckets"]["paths"] == paths and b["buckets"]["capture_errors"] == {}, b["buckets"]
        assert "max_abs_diff" in b["inprocess"] and b["inprocess"]["samples"] == b["inprocess"]["stock_samples"]
    assert by["cadence"]["counters"]["replays"] == 12
