"""``cf.load``: an artifact checked (build, manifest, bounds, environment, digests) and rebuilt into an
:class:`~cadence_fx.program.OptimizedProgram` through an :class:`~cadence_fx.artifact.source.ArtifactSource`.

The device's start-up and the digest check run on threads while this one decodes the graphs and
generates their code (:func:`load` says how the seconds split, in ``prog.load_report``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.fx import GraphModule

from cadence_fx.artifact.environment import (check_build, check_contract, check_environment, device_map,
                                             planned_device, saved_device, start_device)
from cadence_fx.artifact.exceptions import malformed, where
from cadence_fx.artifact.graph_codec import decoded_module
from cadence_fx.artifact.manifest import (check_digests, check_manifest, parse_manifest, read_payload,
                                          storage_bytes, tensor_names)
from cadence_fx.artifact.source import ArtifactSource
from cadence_fx.artifact.values import decode_contract
from cadence_fx.build import Replay, check_lanes
from cadence_fx.contract import Contract
from cadence_fx.gc_paused import cyclic_gc_paused
from cadence_fx.program import OptimizedProgram

__all__ = ["iter_artifact_tensors", "load"]


def load(path: str | os.PathLike[str], *, device: str | torch.device | None = None, replay: Replay | Any = "auto",
         lanes: int = 1, contract: Contract | None = None, check_weights: bool = True,
         sha256: str | None = None) -> OptimizedProgram:
    """An :class:`OptimizedProgram` from an artifact written by :func:`save`, ready for ``warmup``.

    The artifact is data: loading runs no code from it (its graphs name only ATen operators and the
    functions of ``graph_codec._CALLABLES``; nothing it holds reaches generated source or an import) and
    allocates only what its own tensors bound (``manifest.ALLOCATION_FLOOR``). What it computes is what
    its author made it compute, as with a checkpoint: the digests it carries are stored beside what
    they cover, so they catch accidents, not edits. Pin the file with ``sha256``.

    Args:
        path: the artifact.
        device: where to put the program; default (``None``) the device it was saved from. Only
            another index of the same device type and model is accepted (``cuda:0`` -> ``cuda:1`` on
            a host of identical GPUs): the hoisted constants are the bits that device's kernels made.
        replay, lanes: as for :func:`cadence_fx.optimize`.
        contract: the contract the caller expects. Given, it must equal the stored one in every
            field, and its ``admit`` must refuse exactly the classes the stored program refuses; a
            difference is :class:`ArtifactMismatch`. Without it the stored contract is used (with no
            ``admit``: its verdicts are stored per class).
        check_weights: digest every stored tensor (weights, buffers, hoisted constants, workspaces)
            and compare with the SHA-256 recorded at save: a corrupted or altered artifact fails
            here instead of computing wrong bits (a full read, parallel over tensors).
        sha256: the file's SHA-256 as :func:`save` returned it: a file whose bytes differ is refused
            (the file is then read once into memory, and parsed from the bytes that were hashed).

    Raises:
        ArtifactError: not an artifact, unreadable, malformed (named in the message: a graph naming
            something outside the tables, a size beyond the bound, a missing or mistyped entry), a
            digest differs, or the file's SHA-256 is not ``sha256``.
        FileNotFoundError: no file at ``path``.
        ArtifactMismatch: another torch/CUDA version, device, GPU model, kernel setting or contract.
    """
    with cyclic_gc_paused():
        return _load(path, device, replay, lanes, contract, check_weights, sha256)


def _load(path: str | os.PathLike[str], device: str | torch.device | None, replay: Replay | Any, lanes: int,
          contract: Contract | None, check_weights: bool, sha256: str | None) -> OptimizedProgram:
    t0 = time.perf_counter()
    check_lanes(lanes)
    payload = read_payload(Path(path), sha256)
    t_read = time.perf_counter()
    with malformed(path):  # whatever a malformed payload raises while it is decoded: ArtifactError
        manifest = parse_manifest(payload)
        check_build(manifest)  # before decoding: another torch's graphs may name operators this one lacks
        stored = decode_contract(manifest["contract"])
        if contract is not None:
            check_contract(manifest, stored, contract)
        tensors, workspaces = payload["tensors"], payload["workspaces"]
        check_manifest(manifest, tensors, workspaces)  # before anything is decoded or allocated
        planned = planned_device(manifest, device)
        # Three things overlap. The device's own start-up (driver and context: seconds on a large GPU) and
        # the digest check (hashing releases the GIL) run on threads while this one decodes the graphs
        # and generates their code, which needs no device: a restarted server waits for the longest,
        # not the sum, as far as the device's start-up leaves the GIL free (load_report says). The verdict is
        # awaited before the program is handed back: a corrupted artifact still raises before any call.
        with ThreadPoolExecutor(max_workers=2) as helpers:
            started = helpers.submit(_timed, start_device, planned) if planned.type == "cuda" else None
            verdict = helpers.submit(_timed, check_digests, path, tensors, manifest, workspaces) \
                if check_weights else None
            prebuilt, build_seconds = _prebuild_modules(manifest, planned)
            t_prebuilt = time.perf_counter()
            device_init_s = started.result() if started is not None else 0.0
            t_check = time.perf_counter()
            target = check_environment(manifest, device)
            if target != planned:  # "cuda" without an index, resolved now: the device in the graphs differs
                prebuilt, build_seconds = _prebuild_modules(manifest, target)
            tensors = _place(tensors, manifest["tensors"], target)  # the checker keeps the host copies it reads
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            t_place = time.perf_counter()
            source = ArtifactSource(manifest, contract if contract is not None else stored, tensors, workspaces, target,
                                    prebuilt=prebuilt, build_seconds=build_seconds)
            prog = OptimizedProgram(source, replay=replay, lanes=lanes)
            t_built = time.perf_counter()
            check_s = verdict.result() if verdict is not None else 0.0  # raises ArtifactError on a mismatch
    t_end = time.perf_counter()
    # where loading spends its time (benchmarks/cold_start.py reports it)
    prog.load_report = {"read_s": t_read - t0,
                        # graphs decoded and their code generated, beside the device's start-up (its own
                        # seconds; the wait is what it added after the graphs were ready)
                        "prebuild_s": t_prebuilt - t_read, "device_init_s": device_init_s,
                        "device_wait_s": t_check - t_prebuilt,
                        "check_s": check_s, "check_wait_s": t_end - t_built,
                        "place_s": t_place - t_check, "build_s": t_built - t_place, "total_s": t_end - t0,
                        **{f"build_{k}": v for k, v in source.build_seconds.items()},
                        "tensor_bytes": storage_bytes(tensors)}
    return prog


def _prebuild_modules(manifest: Mapping[str, Any], target: torch.device
                      ) -> tuple[dict[tuple[int, str], GraphModule], dict[str, float]]:
    """Every stored graph decoded into a GraphModule with its code generated, attributes not yet set
    (the program attaches the placed tensors); keyed by (program, module path)."""
    map_device = device_map(saved_device(manifest), target)
    seconds = {"decode_s": 0.0, "codegen_s": 0.0}
    out = {(i, m["path"]): decoded_module(m["graph"], map_device, seconds, where(i, m["path"]))
           for i, p in enumerate(manifest["programs"]) for m in p["modules"] if "graph" in m and "alias" not in m}
    return out, seconds


def _place(tensors: list[torch.Tensor], info: list[Mapping[str, Any]], device: torch.device) -> list[torch.Tensor]:
    """Tensors on ``device``, storage sharing kept (one copy per stored storage), parameters as parameters."""
    moved: dict[int, torch.UntypedStorage] = {}
    out = []
    for t, meta in zip(tensors, info):
        st = t.untyped_storage()
        if st.data_ptr() not in moved:
            moved[st.data_ptr()] = st if device.type == "cpu" else st.to(device=device)
        new = torch.empty(0, dtype=t.dtype, device=device)
        new.set_(moved[st.data_ptr()], t.storage_offset(), t.shape, t.stride())
        if meta["parameter"]:
            new = torch.nn.Parameter(new, requires_grad=meta["requires_grad"])
        out.append(new)
    return out


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds ``fn(*args)`` took (its exceptions propagate)."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def iter_artifact_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stored tensors of an artifact by one of their attribute paths (for inspection)."""
    payload = read_payload(Path(path))
    with malformed(path):
        manifest = parse_manifest(payload)
        named = [(tensor_names(manifest, i), t) for i, t in enumerate(payload["tensors"])]
    yield from named
