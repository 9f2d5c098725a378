"""The one table of kernel-selection settings (``cadence_fx.kernel_settings``) and its three readers.

Every setting in the table, flipped between two calls of a warmed-up program, must make the next call
miss the class captured before (run eagerly, counted as ``signature_miss``) and the next warm-up
capture it again: a graph captured under other kernels is never replayed. The artifact check and the
envelope read the same table; an artifact saved under one value of any entry and loaded under another
is refused, naming the entry and how to set it back.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import timeit
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import cadence_fx as cf
from cadence_fx import kernel_settings
from cadence_fx.artifact import environment, manifest as artifact_manifest
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog
from cadence_fx.determinism import envelope_settings
from cadence_fx.kernel_settings import TABLE, UNREADABLE, KernelSetting
from cadence_fx.testing.fake_backend import FakeBackend
from tests.helpers import demo_catalog

CFG = DemoConfig()
NAMES = [s.name for s in TABLE]
# the names cadence_fx's artifacts stored before the table: manifests written then are still checked
LEGACY_ARTIFACT_NAMES = (
    "cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction", "cudnn.allow_tf32", "cudnn.deterministic",
    "cudnn.benchmark", "deterministic_algorithms", "sdpa.cudnn", "sdpa.flash", "sdpa.mem_efficient", "sdpa.math")
# the envelope's keys before the table (results files and benchmarks read them)
LEGACY_ENVELOPE_KEYS = ("cudnn.deterministic", "cudnn.benchmark", "sdpa.cudnn_attention", "deterministic_algorithms",
                        "fill_uninitialized_memory", "float32_matmul_precision", "CUBLAS_WORKSPACE_CONFIG",
                        "torch", "cuda")


def _other(setting: KernelSetting, value: Any) -> Any:
    """A value of ``setting`` other than ``value`` (JSON form)."""
    if isinstance(value, bool):
        return not value
    if setting.choices:
        return next(c for c in setting.choices if c != value)
    if isinstance(value, list):
        return list(reversed(value))
    if value is None:
        return 8  # cuda.sm_carveout: leave 8 SMs to other work
    if isinstance(value, int):
        return value + 1
    raise AssertionError(f"no other value known for {setting.name} = {value!r}: add one to _other")


def _prerequisites(setting: KernelSetting) -> dict[str, Any]:
    """Settings another value of ``setting`` needs first: cuBLAS refuses split-K off while reduced
    precision is allowed."""
    if setting.name.endswith("_split_k"):
        return {setting.name.removesuffix("_split_k"): False}
    return {}


def _write(setting: KernelSetting, v: Any) -> None:
    """Set ``setting`` to ``v`` or skip the test where this build refuses the value (cuBLASLt and
    cuSOLVER in a CPU build, fp16 reductions on an x86 CPU); a real change of what the table reads."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-feature warnings (SM carveout, oneDNN TF32)
            setting.write(v)
    except (RuntimeError, ValueError, TypeError) as e:
        pytest.skip(f"{setting.name} cannot be set to {v!r} in this build: {e}")
    assert setting.value() == v, f"{setting.name}: wrote {v!r}, reads {setting.value()!r}"


@pytest.fixture
def restored():
    """Every kernel setting as found, back after the test (and checked to be back)."""
    before = kernel_settings.snapshot()
    try:
        yield before
    finally:
        left = kernel_settings.apply(before)
        torch.clear_autocast_cache()
        assert not left and kernel_settings.snapshot() == before, left


def _flip_is_never_replayed(setting: KernelSetting, prog: Any, call: Any) -> None:
    """Warm up under the current settings, flip ``setting``: the next call runs eagerly (a signature
    miss), the next warm-up captures it again, and the call after that replays the new class."""
    for name, v in _prerequisites(setting).items():
        _write(kernel_settings._BY_NAME[name], v)
    prog.warmup(*call.example)
    before = prog.counters()
    call()
    warm = prog.counters()
    assert warm["replays"] > before["replays"] and warm["eager"] == before["eager"], (before, warm)

    _write(setting, _other(setting, setting.value()))
    try:
        call()
        raised = None
    except RuntimeError as e:  # eager cannot run under the new value either (sdpa.math off: no kernel left)
        raised = e
    flipped = prog.counters()
    assert flipped["replays"] == warm["replays"], f"{setting.name}: replayed a graph captured under the old value"
    missed = flipped["rejections"].get("signature_miss", 0) - warm["rejections"].get("signature_miss", 0)
    assert flipped["eager"] > warm["eager"] and missed == flipped["eager"] - warm["eager"], (warm, flipped)
    if raised is not None:
        return  # refused and run eagerly, which raised: nothing to capture under this value

    prog.warmup(*call.example)
    assert prog.counters()["captures"] > flipped["captures"], f"{setting.name}: not captured again"
    call()
    again = prog.counters()
    assert again["replays"] > flipped["replays"] and again["eager"] == flipped["eager"], (flipped, again)


class _Call:
    """One call of the demo program from fresh inputs and the initial state (the inputs ``example``)."""

    def __init__(self, prog: Any, model: StreamingDecoder, cfg: DemoConfig, device: str = "cpu") -> None:
        self.prog, self.model, self.cfg, self.device = prog, model, cfg, device
        g = torch.Generator().manual_seed(0)
        self.tok, self.noise = (torch.randn(1, cfg.chunk, cfg.dim, generator=g).to(device) for _ in range(2))
        self.example = (self.tok, *model.initial_state(device=device), self.noise)

    def __call__(self) -> Any:
        return self.prog(self.tok, *self.model.initial_state(device=self.device), self.noise)


@pytest.fixture(scope="module")
def demo():
    model, contract, eps = demo_catalog(CFG)
    return model, contract, eps


# --------------------------------------------------------------------------- the table
def test_the_table_has_every_setting_named_in_issue_27():
    names = set(NAMES)
    for name in ("cuda.matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision", "cudnn.enabled",
                 "cudnn.deterministic", "cudnn.benchmark", "sdpa.flash", "sdpa.mem_efficient", "sdpa.math",
                 "sdpa.cudnn", "autocast.cpu.enabled", "autocast.cpu.dtype", "autocast.cuda.enabled",
                 "autocast.cuda.dtype", "cuda.preferred_blas_library", "cuda.preferred_linalg_library",
                 "cuda.matmul.allow_fp16_reduced_precision_reduction",
                 "cuda.matmul.allow_bf16_reduced_precision_reduction", "deterministic_algorithms",
                 "deterministic_algorithms.warn_only", "fill_uninitialized_memory"):
        assert name in names, name
    if hasattr(torch._C, "_get_cublas_allow_fp16_accumulation"):
        assert "cuda.matmul.allow_fp16_accumulation" in names
    assert len(names) == len(NAMES)
    for s in TABLE:
        assert s.devices and "{v" in s.how, s


def test_snapshot_is_json_and_key_is_hashable_and_cheap():
    snap = kernel_settings.snapshot()
    assert list(snap) == NAMES
    assert json.loads(json.dumps(snap)) == snap
    assert all(v != UNREADABLE for v in snap.values()), snap
    assert snap["autocast.cuda.dtype"] in ("float16", "bfloat16") and isinstance(snap["cuda.preferred_blas_library"], str)
    k = kernel_settings.key()
    hash(k)
    assert len(k) == len(TABLE) and kernel_settings.key() == k
    assert kernel_settings.diff(snap) == []
    # on every call of the hot path: a few microseconds (a bound loose enough for a shared CPU)
    per_call = min(timeit.repeat(kernel_settings.key, number=2000, repeat=3)) / 2000
    assert per_call < 50e-6, f"kernel_settings.key() takes {per_call * 1e6:.1f} us"


def test_mixed_tf32_apis_read_as_unreadable_and_still_key():
    """After the new fp32 precision API set what the legacy TF32 flags also say, torch (2.13; 2.11 does
    not) refuses to read the legacy ones; the key and the snapshot carry on (the fp32 entries hold the
    state). In a fresh process: whether torch calls a state mixed depends on which API set what before."""
    if "fp32_precision" not in NAMES:
        pytest.skip("this torch has no fp32_precision API")
    script = textwrap.dedent("""
        import json
        from cadence_fx import kernel_settings
        from cadence_fx.determinism import envelope_settings
        before = kernel_settings.key()
        kernel_settings._BY_NAME["fp32_precision"].write("ieee")
        snap = kernel_settings.snapshot()
        assert snap["fp32_precision"] == "ieee", snap
        assert kernel_settings.key() != before
        json.dumps(envelope_settings())
        # a saved "unreadable" is not compared: the state is in the fp32 precision entries
        diffs = kernel_settings.diff({"cudnn.allow_tf32": "unreadable", "fp32_precision": "none"})
        assert [d.name for d in diffs] == ["fp32_precision"], diffs
        print("OK", kernel_settings.UNREADABLE in snap.values())
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert run.returncode == 0 and run.stdout.startswith("OK"), run.stderr[-3000:]


def test_a_getter_that_raises_reads_as_unreadable(monkeypatch):
    """The key's fallback when a getter refuses (torch's legacy TF32 flags after mixed API use)."""
    def refuses():
        raise RuntimeError("mixed legacy and new TF32 APIs")

    readers = list(kernel_settings._READERS)
    readers[0] = refuses
    monkeypatch.setattr(kernel_settings, "_READERS", tuple(readers))
    k = kernel_settings.key()
    assert k[0] == UNREADABLE and k[1:] == tuple(s.read() for s in TABLE[1:])
    assert KernelSetting("x", refuses, print, "{v}", ("cpu",)).value() == UNREADABLE


def test_diff_ignores_unknown_names_and_says_how_to_set_back(restored):
    s = kernel_settings._BY_NAME["cudnn.benchmark"]
    saved = {**kernel_settings.snapshot(), "a.setting.of.another.torch": 1}
    _write(s, not saved["cudnn.benchmark"])
    (d,) = kernel_settings.diff(saved)
    assert (d.name, d.saved, d.now) == ("cudnn.benchmark", saved["cudnn.benchmark"], not saved["cudnn.benchmark"])
    assert d.how == f"torch.backends.cudnn.benchmark = {saved['cudnn.benchmark']}" and d.devices == ("cuda",)
    assert kernel_settings.apply(saved) == [] and kernel_settings.diff(saved) == []


# --------------------------------------------------------------------------- one source
def test_the_artifact_check_and_the_envelope_read_the_table(demo, tmp_path):
    model, contract, eps = demo
    env = envelope_settings()
    for key in (*NAMES, *LEGACY_ENVELOPE_KEYS):
        assert key in env, key
    assert env["sdpa.cudnn_attention"] == env["sdpa.cudnn"]
    assert set(LEGACY_ARTIFACT_NAMES) <= set(NAMES)

    prog = cf.optimize(eps, contract, replay="off")
    path = tmp_path / "demo.cfx"
    cf.save(prog, path)
    manifest = artifact_manifest.parse_manifest(artifact_manifest.read_payload(path))
    assert manifest["settings"] == kernel_settings.snapshot()
    # every entry is checked on load: a manifest differing in any one is refused, naming it
    for s in TABLE:
        was = manifest["settings"][s.name]
        other = {**manifest, "settings": {**manifest["settings"], s.name: _other(s, was)}}
        with pytest.raises(cf.ArtifactMismatch, match=rf"{s.name}: saved .*Set: .*"):
            environment.check_environment(other, None)
    # an older writer's manifest (fewer names) and a newer one's (a name this torch lacks) still load
    old = {**manifest, "settings": {k: manifest["settings"][k] for k in LEGACY_ARTIFACT_NAMES}}
    assert environment.check_environment(old, None) == torch.device("cpu")
    newer = {**manifest, "settings": {**manifest["settings"], "a.setting.of.another.torch": True}}
    assert environment.check_environment(newer, None) == torch.device("cpu")


@pytest.fixture(scope="module")
def saved_demo(demo, tmp_path_factory):
    model, contract, eps = demo
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    path = tmp_path_factory.mktemp("kernel_settings") / "demo.cfx"
    cf.save(prog, path)
    return path


@pytest.mark.parametrize("name", NAMES)
def test_an_artifact_loaded_under_another_value_is_refused(name, saved_demo, restored):
    s = kernel_settings._BY_NAME[name]
    assert kernel_settings.diff(restored) == []  # the artifact was saved under these settings
    for dep, v in _prerequisites(s).items():
        _write(kernel_settings._BY_NAME[dep], v)
    _write(s, _other(s, s.value()))
    with pytest.raises(cf.ArtifactMismatch, match=re.escape(f"{name}: saved {restored[name]}, now {s.value()}")) \
            as info:
        cf.load(saved_demo, replay=FakeBackend())
    assert s.set_how(restored[name]) in str(info.value)
    kernel_settings.apply(restored)
    cf.load(saved_demo, replay=FakeBackend())  # and under its own settings it loads


# --------------------------------------------------------------------------- the replay key
@pytest.fixture(scope="module")
def fake_program(demo):
    model, contract, eps = demo
    prog = cf.optimize(eps, contract, replay=FakeBackend())
    return prog, _Call(prog, model, CFG)


@pytest.mark.parametrize("name", NAMES)
def test_a_flipped_setting_is_never_replayed_under_the_old_key(name, fake_program, restored):
    prog, call = fake_program
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast on the CPU, deterministic-algorithm notices
        _flip_is_never_replayed(kernel_settings._BY_NAME[name], prog, call)


@pytest.fixture(scope="module")
def cuda_program():
    cfg = DemoConfig(dim=64, chunk=8, prompt=24, head=24, tail=16, steps=4, slots=6, capacity=128)
    torch.manual_seed(0)
    model = StreamingDecoder(cfg).eval().cuda()
    contract = demo_contract(cfg)
    prog = cf.optimize(export_catalog(model, contract, device="cuda"), contract)  # CUDA graphs
    return prog, _Call(prog, model, cfg, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
def test_a_flipped_setting_is_never_replayed_under_the_old_key_cuda(name, cuda_program, restored, monkeypatch):
    # deterministic cuBLAS needs a fixed workspace configuration, or every product raises
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prog, call = cuda_program
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _flip_is_never_replayed(kernel_settings._BY_NAME[name], prog, call)
    torch.cuda.synchronize()
