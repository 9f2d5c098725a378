"""``cf.save``: lane 0's rewritten programs walked into one tensor table and a JSON manifest, written atomically."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.fx import GraphModule

from cadence_fx import kernel_settings
from cadence_fx.annotations import is_journal_attr
from cadence_fx.artifact.environment import encode_device, program_device
from cadence_fx.artifact.exceptions import ArtifactError
from cadence_fx.artifact.graph_codec import encode_graph
from cadence_fx.artifact.manifest import FORMAT, VERSION, storage_bytes, tensor_digests, write_atomically
from cadence_fx.artifact.values import (dtype_name, encode, encode_contract, encode_facts, encode_plan,
                                        encode_site)
from cadence_fx.determinism import sha256_tensors
from cadence_fx.program import OptimizedProgram
from cadence_fx.runtime.clone import HOOKS, MODULE_INTERNALS, export_guards
from cadence_fx.runtime.lanes import Lane
from cadence_fx.runtime.runners import RandomGuard, ReplayRunner
from cadence_fx.runtime.weights import FoldedWeights, WeightsChanged

__all__ = ["save"]

log = logging.getLogger("cadence_fx")


def save(prog: OptimizedProgram, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``prog`` (an optimized catalog) to ``path`` for :func:`load` in another process.

    Stored: the rewritten programs, every tensor they reference once (with SHA-256 digests), the
    workspaces' bytes as they are now, the contract, the plan, and the torch/device/kernel settings
    the bytes were computed under. Not stored: region buffers (state arrives with each call), sessions,
    CUDA graphs (captured again after loading), counters.

    The file is written to a fresh temporary file in ``path``'s folder (created exclusively, so a
    link planted there is never written through) and renamed over ``path`` (which replaces a link at
    ``path`` rather than writing to its target); on any error the temporary file is removed.

    Returns ``{"bytes", "sha256", "tensors", "tensor_bytes", "programs", "seconds"}``: ``sha256`` is
    the file's (also logged, at INFO, to the ``cadence_fx`` logger), for ``load(path, sha256=...)``.

    Raises:
        ArtifactError: ``prog`` runs in verify mode, or holds something the format cannot store
            (a module with hooks, an attribute that is neither tensor nor module, a call target
            outside the ATen operators and the functions of ``_CALLABLES``, an annotation outside
            ``_META_KINDS``), named in the message.
        WeightsChanged: a weight the hoisted constants were computed from changed since ``optimize``.
    """
    t0 = time.perf_counter()
    if not isinstance(prog, OptimizedProgram):
        raise TypeError(f"cadence_fx.save takes an OptimizedProgram, got {type(prog).__name__}")
    if prog.auditor is not None:
        raise ArtifactError("cadence_fx.save: the program runs in verify mode (optimize(..., verify=True)), a "
                            "debugging mode whose audits hold Python objects; save a program optimized with "
                            "verify=False")
    for fw in prog.folded_weights():
        fw.check()  # an in-place edit since optimize: the stored constants would be stale
    lane = prog.lanes.lanes[0]
    writer = _Writer(lane)
    programs = []
    for i, (key, entry) in enumerate(lane.catalog.items()):
        programs.append({
            "key": encode(key),
            "sites": {name: encode_site(site) for name, site in entry.sites.items()},
            "admitted": entry.admitted,
            "facts": encode_facts(entry.facts),
            "modules": writer.modules(entry.gm, f"program {i}"),
        })
    # regions kept in module buffers: where they sit in the lifted programs, and their first values
    # (entries of the tensor table: digested and placed like every other stored tensor)
    br = prog.buffer_regions
    buffer_regions = None if not br else {
        "inputs": dict(br.inputs), "outputs": dict(br.outputs), "visible": list(br.visible_names),
        "out_spec": pytree.treespec_dumps(br.out_spec),
        "initial": {name: writer.ref(t)[1] for name, t in br.initial.items()}}
    tensors = writer.tensors
    digests = tensor_digests(tensors)
    # Weights the hoisted cones read and nothing else does (the DiT's adaLN projections, whose every
    # output is a hoisted constant) are not stored: the loaded program cannot reach them. The ones it
    # keeps stay guarded against in-place edits, with the digests optimize took.
    unstored: dict[int, str] = {}
    for p, (_key, entry) in zip(programs, lane.catalog.items()):
        p["folded"] = writer.folded(entry.facts.folded_weights)
        sources = entry.facts.folded_weights.sources if entry.facts.folded_weights is not None else []
        for name, idx, _digest in p["folded"] or ():
            if idx is None:
                t = next(t for n, t, _v in sources if n == name)
                unstored.setdefault(id(t), sha256_tensors(t))
    # a weight edited through .data since optimize: its folded constants no longer match its bytes
    for p, (_key, entry) in zip(programs, lane.catalog.items()):
        sources = entry.facts.folded_weights.sources if entry.facts.folded_weights is not None else []
        for name, idx, digest in p["folded"] or ():
            t = next(t for n, t, _v in sources if n == name)
            now = digests[idx] if idx is not None else unstored[id(t)]
            if now != digest:
                raise WeightsChanged(f"weight {name!r} differs from its bytes when cadence_fx.optimize computed "
                                     f"constants from it (an edit through .data); optimize again before saving")
    workspaces = []
    stored_ws: list[torch.Tensor | None] = []
    for t in writer.workspaces:
        zero = not bool(t.count_nonzero()) if t.numel() else True
        workspaces.append({"shape": list(t.shape), "dtype": dtype_name(t.dtype), "zero": zero,
                           "sha256": None if zero else sha256_tensors(t)})
        stored_ws.append(None if zero else t.detach())
    device = program_device(lane, tensors)
    manifest = {
        "format": FORMAT, "version": VERSION,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": encode_device(device),
        "settings": kernel_settings.snapshot(),
        "contract": encode_contract(prog.contract),
        "state_rule": prog.state_rule,
        "names": prog.program_input_names,
        "buffer_regions": buffer_regions,
        "plan": encode_plan(prog.plan),
        "passes": dict(prog.stats["passes"]),
        "tensors": [{"sha256": d, "parameter": isinstance(t, torch.nn.Parameter), "requires_grad": t.requires_grad}
                    for t, d in zip(tensors, digests)],
        "workspaces": workspaces,
        "programs": programs,
    }
    text = json.dumps(manifest, separators=(",", ":"), allow_nan=False)
    payload = {"format": FORMAT, "manifest": text, "manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
               "tensors": [t.detach() for t in tensors], "workspaces": stored_ws}
    path = Path(path)
    digest = write_atomically(path, payload)
    size = path.stat().st_size
    log.info("cadence_fx.save: wrote %s (%d bytes, SHA-256 %s)", path, size, digest)
    return {"bytes": size, "sha256": digest, "tensors": len(tensors),
            "tensor_bytes": storage_bytes(tensors), "programs": len(programs),
            "seconds": time.perf_counter() - t0}


class _Writer:
    """Walks lane 0's programs: one table of tensors (by identity), the state tensors by role."""

    def __init__(self, lane: Lane) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self.regions = {id(t): name for name, t in lane.state.region_buffers.items()}
        self.workspaces = list(lane.state.workspaces())
        self._ws = {id(t): j for j, t in enumerate(self.workspaces)}
        self._journals: dict[int, int] = {}

    def ref(self, t: torch.Tensor) -> list[Any]:
        """How an attribute names a tensor: a region buffer, a workspace, or an entry of the table."""
        if id(t) in self.regions:
            return ["region", self.regions[id(t)]]
        if id(t) in self._ws:
            return ["workspace", self._ws[id(t)]]
        if id(t) not in self._index:
            self._index[id(t)] = len(self.tensors)
            self.tensors.append(t)
        return ["tensor", self._index[id(t)]]

    def journal(self, t: torch.Tensor) -> list[Any]:
        """A journal buffer: its shape and dtype (its bytes are scratch); one per tensor of the program."""
        if id(t) not in self._journals:
            self._journals[id(t)] = len(self._journals)
        return ["journal", [self._journals[id(t)], list(t.shape), dtype_name(t.dtype)]]

    def folded(self, fw: FoldedWeights | None) -> list[list[Any]] | None:
        if fw is None:
            return None
        # called after every module is walked: a source no module references gets no table entry
        return [[name, self._index.get(id(t)), fw.digests[name]] for name, t, _v in fw.sources if name in fw.digests]

    def modules(self, root: GraphModule, where: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        seen: dict[int, str] = {}

        def walk(mod: torch.nn.Module, path: str) -> None:
            # the replay runners and random guards are the runtime's; the program is what they wrap
            while isinstance(mod, (ReplayRunner, RandomGuard)):
                mod = mod.fn
            if id(mod) in seen:
                out.append({"path": path, "alias": seen[id(mod)]})
                return
            seen[id(mod)] = path
            at = f"{where}, module {path or '<root>'!r}"
            if not path and hasattr(mod, "range_constraints"):
                # ``ExportedProgram.module()`` itself (pytree specs, input checks as hooks): partitioning
                # replaces that root whenever the contract wraps something
                raise ArtifactError(f"cadence_fx.save: {where} is the unpartitioned exported module (the contract "
                                    f"wraps nothing); wrap a callable or the whole step (cf.WHOLE_STEP) to save it")
            for hooks in HOOKS:
                if getattr(mod, hooks, None):
                    raise ArtifactError(f"cadence_fx.save: {at} has {hooks}; a stored program cannot carry hooks")
            entry: dict[str, Any] = {"path": path}
            guards = export_guards(mod)
            if isinstance(mod, GraphModule):
                entry["graph"] = encode_graph(mod.graph, at, skip=guards)
            elif type(mod) is not torch.nn.Module:
                raise ArtifactError(f"cadence_fx.save: {at} is a {type(mod).__qualname__}; only graph modules and "
                                    f"plain containers can be stored (the program must be what the passes produced)")
            attrs = []
            for name, p in mod._parameters.items():
                attrs.append([name, "parameter", None if p is None else self.ref(p)])
            for name, b in mod._buffers.items():
                kind = "buffer" if name not in mod._non_persistent_buffers_set else "buffer_np"
                attrs.append([name, kind, None if b is None else self.journal(b) if is_journal_attr(name)
                              else self.ref(b)])
            for name, v in vars(mod).items():
                if name in MODULE_INTERNALS:
                    continue
                if isinstance(v, torch.Tensor):
                    attrs.append([name, "attribute", self.journal(v) if is_journal_attr(name) else self.ref(v)])
                else:
                    raise ArtifactError(f"cadence_fx.save: {at} holds attribute {name!r} of type {type(v).__name__}, "
                                        f"which the artifact cannot store")
            entry["attrs"] = attrs
            entry["children"] = [name for name in mod._modules if name not in guards]
            out.append(entry)
            for name, child in mod._modules.items():
                if child is not None and name not in guards:
                    walk(child, f"{path}.{name}" if path else name)

        walk(root, "")
        return out
