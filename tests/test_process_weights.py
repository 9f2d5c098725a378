"""One copy of the weights across worker processes (``cadence_fx.runtime.process_weights``).

The CPU tests check what fails closed before any CUDA IPC handle is opened (no publication, a tampered
or foreign file, other names or shapes, CPU weights); the CUDA tests publish from a child process and
map into this one: outputs bitwise equal, the memory given back, other bytes refused with every
parameter unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cadence_fx.runtime.process_weights import (FORMAT, PublishedWeights, WeightsNotShared, _mismatches,
                                                map_weights, publish_weights, read_publication)


def _model(seed: int = 0, width: int = 64, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8)).to(device).eval()


def _entry(p: torch.Tensor) -> dict:
    return dict(shape=list(p.shape), stride=list(p.stride()), storage_offset=0, dtype=str(p.dtype)[6:],
                nbytes=p.numel() * p.element_size(), cuda=[0, "00" * 64, 0, 0, "ab", 0, "", False])


def _publication(m: nn.Module) -> PublishedWeights:
    return PublishedWeights(1, "GPU-x", {n: _entry(p) for n, p in m.named_parameters()})


def test_no_publication_is_an_error_after_the_wait(tmp_path):
    with pytest.raises(WeightsNotShared, match="no weights published"):
        read_publication(tmp_path / "absent.json", wait_s=0.3)


@pytest.mark.parametrize("text", ["not json", json.dumps([1, 2]), json.dumps({"format": "pickle", "entries": {}}),
                                  json.dumps({"format": FORMAT, "entries": {"w": {"shape": [2]}}}),
                                  json.dumps({"format": FORMAT, "entries": {"w": dict(
                                      shape=[2], stride=[1], storage_offset=0, dtype="os.system", nbytes=8,
                                      cuda=[0, "zz", 0, 0, "", 0, "", False])}})])
def test_a_tampered_publication_is_refused(tmp_path, text):
    f = tmp_path / "w.json"
    f.write_text(text)
    with pytest.raises(WeightsNotShared):
        read_publication(f)


def test_geometry_mismatches_are_named_without_opening_a_handle():
    m = _model()
    pub = _publication(m)
    assert _mismatches(m, pub) == []
    wider = _model(width=32)
    bad = _mismatches(wider, pub)
    assert any(b.startswith("0.weight: shape/stride/dtype") for b in bad)
    extra = nn.Sequential(*m, nn.Linear(8, 2))
    assert "3.weight: not published" in _mismatches(extra, pub)
    pub.entries["ghost"] = _entry(torch.zeros(3))
    assert "ghost: published, not a parameter here" in _mismatches(m, pub)


def test_cpu_weights_are_refused_and_left_alone(tmp_path):
    m = _model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(WeightsNotShared, match="only CUDA weights"):
        publish_weights(m, tmp_path / "w.json")
    assert not (tmp_path / "w.json").exists()
    (tmp_path / "w.json").write_text(json.dumps(dict(format=FORMAT, pid=1, device_uuid="GPU-x",
                                                     entries={n: _entry(p) for n, p in m.named_parameters()})))
    with pytest.raises(WeightsNotShared, match="published on GPU"):
        map_weights(m, tmp_path / "w.json")
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


# --------------------------------------------------------------------------- CUDA: two processes
PUBLISHER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {root!r})
    from tests.test_process_weights import _model
    from cadence_fx.runtime.process_weights import publish_weights
    m = _model(seed={seed}, width=1024, device="cuda")
    publish_weights(m, {path!r})
    print("published", flush=True)
    sys.stdin.read()  # alive until the test is done with the mapping
""")


def _publisher(tmp_path, seed: int):
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    path = str(tmp_path / "w.json")
    p = subprocess.Popen([sys.executable, "-c", PUBLISHER.format(root=root, seed=seed, path=path)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "published"
    return p, path


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mapped_weights_give_the_same_bytes_and_free_the_copy(tmp_path):
    p, path = _publisher(tmp_path, seed=3)
    try:
        m = _model(seed=3, width=1024, device="cuda")
        x = torch.randn(16, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        want = m(x)
        ptrs = {n: q.data_ptr() for n, q in m.named_parameters()}
        freed = map_weights(m, path)
        assert freed == sum(q.numel() * q.element_size() for q in m.parameters())
        assert all(q.data_ptr() != ptrs[n] for n, q in m.named_parameters())
        assert torch.equal(m(x), want)
        other = _model(seed=4, width=1024, device="cuda")
        before = {n: (q.data_ptr(), q.detach().clone()) for n, q in other.named_parameters()}
        with pytest.raises(WeightsNotShared, match="other bytes"):
            map_weights(other, path)
        assert all(q.data_ptr() == before[n][0] and torch.equal(q, before[n][1]) for n, q in other.named_parameters())
        print(f"[process-weights] mapped {freed / 2**20:.1f} MiB from pid {p.pid}; other bytes refused")
    finally:
        p.stdin.close()
        p.wait(timeout=60)

