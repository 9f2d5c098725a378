"""What an artifact's bytes depend on, checked on load: the torch and CUDA build, the device (and the GPU
model), the kernel-selection settings (:mod:`cadence_fx.kernel_settings`) and the contract. A
difference is :class:`~cadence_fx.artifact.exceptions.ArtifactMismatch`: the stored constants are the
bits that build, device and settings made.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from cadence_fx import kernel_settings
from cadence_fx.artifact.exceptions import ArtifactError, ArtifactMismatch
from cadence_fx.artifact.values import canonical, encode_contract
from cadence_fx.contract import Contract
from cadence_fx.runtime.lanes import Lane

__all__ = ["check_build", "check_contract", "check_environment", "device_map", "encode_device", "planned_device",
           "program_device", "saved_device", "start_device"]


def check_build(manifest: Mapping[str, Any]) -> None:
    """ArtifactMismatch when the artifact comes from another torch or CUDA build (asks no device)."""
    built = manifest["torch"], manifest["cuda"]
    if built != (torch.__version__, torch.version.cuda):
        raise ArtifactMismatch(
            f"cadence_fx.load: the artifact was built with torch {built[0]} (CUDA {built[1]}), this process runs "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}); kernels and hence bits may differ: optimize "
            f"again under this torch and save")


def check_environment(manifest: Mapping[str, Any], device: str | torch.device | None) -> torch.device:
    """The device to load on; ArtifactMismatch when the bits would not be this device's (the build is
    checked first, by :func:`check_build`)."""
    dev = manifest["device"]
    saved = saved_device(manifest)
    target = saved if device is None else torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if target.type != saved.type:
        raise ArtifactMismatch(f"cadence_fx.load: the artifact was optimized on {saved} ({dev['name']}), not "
                               f"loadable on {target}: its hoisted constants are the bits {saved.type} kernels make")
    if target.type == "cuda":
        if not torch.cuda.is_available() or target.index >= torch.cuda.device_count():
            raise ArtifactMismatch(f"cadence_fx.load: the artifact needs {target} ({dev['name']}), which this process "
                                   f"does not have")
        name = torch.cuda.get_device_name(target)
        if name != dev["name"]:
            raise ArtifactMismatch(f"cadence_fx.load: the artifact was optimized on a {dev['name']}, {target} is a "
                                   f"{name}: kernel choice and bits may differ; optimize again on this GPU")
    kernel_settings.settle(target)  # the settings torch sets at their first use, as every later call sees them
    # settings unknown to this torch's table are ignored, as are the table's entries an older writer lacked
    diffs = kernel_settings.diff(manifest["settings"])
    if diffs:
        raise ArtifactMismatch(
            "cadence_fx.load: kernel settings differ from the ones the artifact was built under ("
            + ", ".join(f"{d.name}: saved {d.saved}, now {d.now}" for d in diffs)
            + "); the stored constants and the stock program's bits depend on them. Set: "
            + "; ".join(d.how for d in diffs))
    return target


def check_contract(manifest: Mapping[str, Any], stored: Contract, given: Contract) -> None:
    mine, theirs = encode_contract(given), manifest["contract"]
    for key in theirs:
        if key == "admit":
            continue
        if canonical(mine.get(key)) != canonical(theirs[key]):
            raise ArtifactMismatch(f"cadence_fx.load: the given contract differs from the artifact's in {key!r}: "
                                   f"given {mine.get(key)!r}, stored {theirs[key]!r}")
    for i, p in enumerate(manifest["programs"]):
        values = {c.name: c.stride for c in given.clocks}
        values.update({name: s["shape"][s["axis"]] for name, s in p["sites"].items()})
        verdict = True if given.admit is None else bool(given.admit(values))
        if verdict != p["admitted"]:
            raise ArtifactMismatch(f"cadence_fx.load: the given contract's admit {'admits' if verdict else 'refuses'} "
                                   f"class {values}, which the stored program {'refuses' if verdict else 'admits'}")


def saved_device(manifest: Mapping[str, Any]) -> torch.device:
    """The device the artifact was optimized on."""
    dev = manifest["device"]
    return torch.device(dev["type"], dev["index"]) if dev["type"] == "cuda" else torch.device(dev["type"])


def planned_device(manifest: Mapping[str, Any], device: str | torch.device | None) -> torch.device:
    """The device the program will go to, as far as it is known without asking the device
    (:func:`check_environment` decides, after the device has started)."""
    target = saved_device(manifest) if device is None else torch.device(device)
    return torch.device("cuda", 0) if target.type == "cuda" and target.index is None else target


def device_map(saved: torch.device, target: torch.device) -> Callable[[torch.device], torch.device]:
    """Devices named in the stored graphs -> this process's: the saved CUDA device becomes ``target``."""
    def map_device(d: torch.device) -> torch.device:
        same = d.type == saved.type == "cuda" and (d.index or 0) == (saved.index or 0)
        return target if same else d
    return map_device


def start_device(device: torch.device) -> None:
    """Create the device's context (the first allocation does), if this process has that device; a
    missing device is reported by :func:`check_environment`, with the artifact's words."""
    if torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count():
        torch.empty(1, device=device)


def program_device(lane: Lane, tensors: list[torch.Tensor]) -> torch.device:
    devices = {t.device for t in list(lane.state.tensors()) + tensors if t.numel()}
    accel = {d for d in devices if d.type != "cpu"}
    if len(accel) > 1:
        raise ArtifactError(f"cadence_fx.save: the program spans devices {sorted(map(str, accel))}; an artifact "
                            f"holds a program on one device")
    return next(iter(accel)) if accel else torch.device("cpu")


def encode_device(d: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(d) if d.type == "cuda" else d.type
    return {"type": d.type, "index": d.index if d.type != "cuda" else (d.index or 0), "name": name}
