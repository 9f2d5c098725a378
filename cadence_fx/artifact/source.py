"""The artifact's program source: each lane's programs rebuilt from the stored graphs (:mod:`cadence_fx.build`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from cadence_fx.artifact.environment import device_map, saved_device
from cadence_fx.artifact.exceptions import ArtifactError, where
from cadence_fx.artifact.graph_codec import decoded_module
from cadence_fx.artifact.values import STORED_FACTS, decode, decode_fact, decode_plan, decode_site, parse_dtype
from cadence_fx.buffer_regions import NO_BUFFER_REGIONS, BufferRegions
from cadence_fx.binding import RegionSite
from cadence_fx.contract import Contract
from cadence_fx.passes import ProgramFacts
from cadence_fx.plan import Plan
from cadence_fx.runtime.weights import FoldedWeights
from cadence_fx.runtime.workspaces import CatalogTables, SharedWorkspace

__all__ = ["ArtifactSource"]


def decode_buffer_regions(stored: Any, names: list[str], contract: Contract,
                          tensors: list[torch.Tensor]) -> BufferRegions:
    """The stored module-buffer regions, checked against the stored programs' inputs and contract."""
    if stored is None:
        return NO_BUFFER_REGIONS
    if not isinstance(stored, dict) or set(stored) != {"inputs", "outputs", "visible", "out_spec", "initial"}:
        raise ArtifactError("buffer_regions: malformed entry")
    regions = {r.name: r for r in contract.regions}
    inputs, outputs, initial = stored["inputs"], stored["outputs"], stored["initial"]
    for table in (inputs, outputs, initial):
        if not isinstance(table, dict) or set(table) - set(regions) or set(table) != set(inputs):
            raise ArtifactError("buffer_regions: the regions named are not the contract's")
    for name, i in inputs.items():
        if type(i) is not int or not 0 <= i < len(names) or names[i] != regions[name].input \
                or outputs[name] != regions[name].output:
            raise ArtifactError(f"buffer_regions: region {name!r} does not sit where the contract says")
        if type(initial[name]) is not int or not 0 <= initial[name] < len(tensors):
            raise ArtifactError(f"buffer_regions: region {name!r}'s initial value names no stored tensor")
    visible = stored["visible"]
    if not isinstance(visible, list) or visible != [n for i, n in enumerate(names) if i not in set(inputs.values())]:
        raise ArtifactError("buffer_regions: the visible inputs are not the programs' inputs less the regions")
    if not isinstance(stored["out_spec"], str):
        raise ArtifactError("buffer_regions: malformed output tree")
    out_spec = pytree.treespec_loads(stored["out_spec"])  # JSON of registered node types only: no code
    return BufferRegions(dict(inputs), dict(outputs), {n: tensors[i] for n, i in initial.items()}, out_spec,
                         tuple(visible))


class ArtifactSource:
    """The programs of an artifact: each lane's rebuilt from the stored graphs, over the placed tensors.

    ``prebuilt``: the graphs :func:`~cadence_fx.artifact.loading.load` decoded ahead (the first lane's
    modules, by program and module path); a further lane the passes would build (one whose programs
    cannot be copied) decodes its own. ``build_seconds`` sums the decoding and code generation.
    """

    label = "cadence_fx load"
    copyable = True
    auditor = None  # verify mode is never saved
    shared_bytes = 0

    def __init__(self, manifest: Mapping[str, Any], contract: Contract, tensors: list[torch.Tensor],
                 workspaces: list[torch.Tensor | None], device: torch.device, *,
                 prebuilt: dict[tuple[int, str], GraphModule] | None = None,
                 build_seconds: dict[str, float] | None = None) -> None:
        self._manifest = manifest
        self._tensors = tensors
        self._stored_workspaces = workspaces
        self._device = device
        self._map_device = device_map(saved_device(manifest), device)
        programs = manifest["programs"]
        self.contract = contract
        self.sites: list[dict[str, RegionSite]] = [
            {name: decode_site(s, contract, device) for name, s in p["sites"].items()} for p in programs]
        self._admitted = [bool(p["admitted"]) for p in programs]
        self.plan: Plan = decode_plan(manifest["plan"])
        self.names: list[str] = list(manifest["names"])
        self.buffer_regions = decode_buffer_regions(manifest.get("buffer_regions"), self.names, contract, tensors)
        self.state_rule = bool(manifest["state_rule"])
        # graphs decoded ahead (the first lane's modules); a further lane decodes its own
        self._prebuilt = dict(prebuilt or {})
        self.build_seconds = dict(build_seconds or {"decode_s": 0.0, "codegen_s": 0.0})  # summed over programs

    def admitted(self, index: int, *, log_refusal: bool) -> bool:
        """The verdict stored per class (the contract's ``admit`` is code, not stored)."""
        return self._admitted[index]

    def rewrite(self, index: int, facts: ProgramFacts, tables: CatalogTables) -> tuple[tuple, GraphModule]:
        """Program ``index`` as stored, its attributes this lane's: the placed tensors, ``facts``' region
        buffers, one copy per lane of each workspace (in ``tables``)."""
        p = self._manifest["programs"][index]
        ws_tables = tables.workspaces

        def tensor(ref: list[Any]) -> torch.Tensor:
            kind, x = ref
            if kind == "tensor":
                return self._tensors[x]
            if kind == "region":
                return facts.region_buffers[x]
            if kind == "journal":  # scratch of one call: zeros, one per lane, shared by the lane's modules
                j, shape, dtype = x
                got = tables.journals.get((index, j))
                if got is None:
                    got = tables.journals[(index, j)] = torch.zeros(shape, dtype=parse_dtype(dtype), device=self._device)
                return got
            key = ("artifact", x)  # one copy per lane, shared by the lane's programs
            if key not in ws_tables:
                w = self._manifest["workspaces"][x]
                stored = self._stored_workspaces[x]
                t = torch.zeros(w["shape"], dtype=parse_dtype(w["dtype"]), device=self._device) if stored is None \
                    else stored.to(self._device, copy=True)
                ws_tables[key] = SharedWorkspace(stock=None, bounds=list(w["shape"]), tensor=t)
            return ws_tables[key].tensor  # type: ignore[return-value]

        modules: dict[str, torch.nn.Module] = {}
        for m in p["modules"]:
            if "alias" in m:  # one module reached by two paths (a shared submodule): attached at both
                modules[m["path"]] = modules[m["alias"]]
                if m["path"]:
                    parent, _, leaf = m["path"].rpartition(".")
                    modules[parent].add_module(leaf, modules[m["alias"]])
                continue
            mod: torch.nn.Module | None = torch.nn.Module() if "graph" not in m else \
                self._prebuilt.pop((index, m["path"]), None)  # the first lane's: decoded by load
            if mod is None:  # a further lane decodes its own
                mod = decoded_module(m["graph"], self._map_device, self.build_seconds, where(index, m["path"]))
            for name, kind, ref in m["attrs"]:
                t = None if ref is None else tensor(ref)
                if kind == "parameter":
                    if t is not None and not isinstance(t, torch.nn.Parameter):
                        t = torch.nn.Parameter(t, requires_grad=False)
                    mod.register_parameter(name, t)  # type: ignore[arg-type]
                elif kind in ("buffer", "buffer_np"):
                    mod.register_buffer(name, t, persistent=kind == "buffer")
                elif hasattr(mod, name):  # a plain attribute: never one the module has (forward, graph)
                    raise ArtifactError(f"{where(index, m['path'])}: attribute {name!r} would replace the "
                                        f"module's own")
                else:
                    setattr(mod, name, t)
            modules[m["path"]] = mod
            if m["path"]:
                parent, _, leaf = m["path"].rpartition(".")
                modules[parent].add_module(leaf, mod)
        root = modules[""]
        assert isinstance(root, GraphModule)
        for k, v in p["facts"].items():  # the passes' counts and notes, as optimize recorded them
            if k in STORED_FACTS:
                setattr(facts, k, decode_fact(k, v))
        if p["folded"] is not None:
            fw = FoldedWeights()
            for name, idx, digest in p["folded"]:
                if idx is None:  # read only by hoisted cones: not part of the loaded program
                    continue
                t = self._tensors[idx]
                fw.sources.append((name, t, t._version))
                fw.digests[name] = digest
            facts.folded_weights = fw
        key = decode(p["key"])
        return tuple(key), root
