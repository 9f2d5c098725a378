"""Saving an optimized catalog and loading it in a fresh process: ``cf.save(prog, path)`` / ``cf.load(path)``.

A restarted server would otherwise export the catalog and run ``optimize`` again before its first
chunk (Token2Wav at released sizes: 74 s + 21 s on an H200). Profiling ``optimize`` (Token2Wav at
reduced sizes, CPU) puts its time in graph work, not in kernels: ``ep.module()`` (unlifting, about a
third), the passes' analyses, ``split_module``, and generating and compiling each module's Python code
again after each pass; evaluating the hoisted cones is the only compute and digesting the weights
they read the only full read. So the artifact stores the *result* of the pipeline, not its input:

- every rewritten program of the catalog as it left the passes (lane 0, before any replay runner is
  installed): each module's graph (nodes, arguments, the ``cadence_*`` annotations the runtime
  reads), the module tree and which tensor each attribute is. Graphs are stored as JSON whose call
  targets are resolved by name against ATen (``torch.ops``) and a few allowed modules, so loading
  executes no stored code;
- every tensor those programs reference once, however many programs and modules share it
  (weights, buffers, the hoisted and folded constants), each with its SHA-256; the folded weights'
  digests from ``optimize`` are stored too, so the per-call guard and ``verify_weights`` work
  without digesting them again;
- the workspaces' bytes (all-zero ones as a shape only), the contract, the plan, the region sites,
  each class's admission, and what the bytes depend on: torch and CUDA versions, the device (and the
  GPU model), the kernel-selection settings.

Region buffers are not stored: a loaded program's first call copies its state input in, as a fresh
program's does. :func:`load` rebuilds each module from its stored graph (code generated once per
module), allocates the region buffers and workspaces per lane, and installs the replay runners. CUDA
graphs bind addresses in one process: they are captured again (``prog.warmup``).

The format is one file written by ``torch.save`` and read with ``torch.load(weights_only=True)``.
``torch.export.save`` is not used for the rewritten programs: its serializer takes functional exported
programs, and these are not (in-place writes into contract-owned buffers, partitions as submodules,
annotations); rebuilding them from the stock programs on load would cost the whole pipeline, which is
what the artifact exists to skip. Loading needs neither the model's code nor the upstream packages.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from cadence_fx.annotations import ReplaySpec, REPLAY
from cadence_fx.binding import RegionSite
from cadence_fx.contract import Clock, Contract, HeadTail, Region, Ring, SlidingWindow
from cadence_fx.determinism import sha256_tensors
from cadence_fx.passes import CatalogTables, ProgramFacts, SharedWorkspace
from cadence_fx.passes.hoist_constants import FoldedWeights, WeightsChanged
from cadence_fx.plan import Plan, RegionPlan
from cadence_fx.program import OptimizedProgram, Replay, _check_lanes
from cadence_fx.runtime.clone import HOOKS as _HOOKS, MODULE_INTERNALS as _MODULE_INTERNALS
from cadence_fx.runtime.clone import export_guards as _export_guards
from cadence_fx.runtime.runners import RandomGuard, ReplayRunner

__all__ = ["ArtifactError", "ArtifactMismatch", "load", "save"]

FORMAT = "cadence_fx.artifact"
VERSION = 1
_META_PREFIX = "cadence_"  # node.meta keys the passes write for the runtime (cadence_fx.annotations)

# modules whose functions a graph may call (besides ATen operators): resolved by name on load
_CALLABLE_MODULES = ("_operator", "operator", "builtins", "math", "torch", "cadence_fx")
# settings that change which kernel runs, hence the bits of hoisted constants and of every call
_KERNEL_SETTINGS: dict[str, tuple[Callable[[], Any], str]] = {
    "cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                               "torch.backends.cuda.matmul.allow_tf32 = {v}"),
    "cuda.matmul.allow_fp16_reduced_precision_reduction": (
        lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = {v}"),
    "cuda.matmul.allow_bf16_reduced_precision_reduction": (
        lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = {v}"),
    "cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32, "torch.backends.cudnn.allow_tf32 = {v}"),
    "cudnn.deterministic": (lambda: torch.backends.cudnn.deterministic, "torch.backends.cudnn.deterministic = {v}"),
    "cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark, "torch.backends.cudnn.benchmark = {v}"),
    "deterministic_algorithms": (torch.are_deterministic_algorithms_enabled,
                                 "torch.use_deterministic_algorithms({v})"),
    # which attention kernels scaled_dot_product_attention may dispatch to
    "sdpa.cudnn": (torch.backends.cuda.cudnn_sdp_enabled, "torch.backends.cuda.enable_cudnn_sdp({v})"),
    "sdpa.flash": (torch.backends.cuda.flash_sdp_enabled, "torch.backends.cuda.enable_flash_sdp({v})"),
    "sdpa.mem_efficient": (torch.backends.cuda.mem_efficient_sdp_enabled,
                           "torch.backends.cuda.enable_mem_efficient_sdp({v})"),
    "sdpa.math": (torch.backends.cuda.math_sdp_enabled, "torch.backends.cuda.enable_math_sdp({v})"),
}


class ArtifactError(RuntimeError):
    """An artifact that cannot be written (a program holding something it cannot store) or read
    (not an artifact, truncated, corrupted: a digest differs)."""


class ArtifactMismatch(ArtifactError):
    """An intact artifact built for another torch, device, kernel settings or contract: its bytes are
    the optimized program's only there."""


# ====================================================================== save
def save(prog: OptimizedProgram, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``prog`` (an optimized catalog) to ``path`` for :func:`load` in another process.

    Stored: the rewritten programs, every tensor they reference once (with SHA-256 digests), the
    workspaces' bytes as they are now, the contract, the plan, and the torch/device/kernel settings
    the bytes were computed under. Not stored: region buffers (state arrives with each call), sessions,
    CUDA graphs (captured again after loading), counters.

    Returns ``{"bytes", "tensors", "tensor_bytes", "programs", "seconds"}``.

    Raises:
        ArtifactError: ``prog`` runs in verify mode, or holds something the format cannot store
            (a module with hooks, an attribute that is neither tensor nor module, a call target outside
            ATen and the allowed modules), named in the message.
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
            "key": _enc(key),
            "sites": {name: _site_enc(site) for name, site in entry.sites.items()},
            "admitted": entry.admitted,
            "facts": _facts_enc(entry.facts),
            "modules": writer.modules(entry.gm, f"program {i}"),
        })
    tensors = writer.tensors
    digests = _digests(tensors)
    # Weights the hoisted cones read and nothing else does (the DiT's adaLN projections, whose every
    # output is a hoisted constant) are not stored: the loaded program cannot reach them. The ones it
    # keeps stay guarded against in-place edits, with the digests optimize took.
    unstored: dict[int, str] = {}
    for p, (_key, entry) in zip(programs, lane.catalog.items()):
        p["folded"] = writer.folded(entry.facts.folded_weights)
        for name, idx, _digest in p["folded"] or ():
            if idx is None:
                t = next(t for n, t, _v in entry.facts.folded_weights.sources if n == name)
                unstored.setdefault(id(t), sha256_tensors(t))
    # a weight edited through .data since optimize: its folded constants no longer match its bytes
    for p, (_key, entry) in zip(programs, lane.catalog.items()):
        for name, idx, digest in p["folded"] or ():
            t = next(t for n, t, _v in entry.facts.folded_weights.sources if n == name)
            now = digests[idx] if idx is not None else unstored[id(t)]
            if now != digest:
                raise WeightsChanged(f"weight {name!r} differs from its bytes when cadence_fx.optimize computed "
                                     f"constants from it (an edit through .data); optimize again before saving")
    workspaces = []
    stored_ws: list[torch.Tensor | None] = []
    for t in writer.workspaces:
        zero = not bool(t.count_nonzero()) if t.numel() else True
        workspaces.append({"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "zero": zero,
                           "sha256": None if zero else sha256_tensors(t)})
        stored_ws.append(None if zero else t.detach())
    device = _program_device(lane, tensors)
    manifest = {
        "format": FORMAT, "version": VERSION,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": _device_enc(device),
        "settings": {k: get() for k, (get, _fix) in _KERNEL_SETTINGS.items()},
        "contract": _contract_enc(prog.contract),
        "state_rule": prog.state_rule,
        "names": list(prog._names),
        "plan": _plan_enc(prog.plan),
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
    tmp = path.with_name(path.name + ".partial")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a truncated artifact under the real name
    return {"bytes": path.stat().st_size, "tensors": len(tensors),
            "tensor_bytes": _storage_bytes(tensors), "programs": len(programs),
            "seconds": time.perf_counter() - t0}


class _Writer:
    """Walks lane 0's programs: one table of tensors (by identity), the state tensors by role."""

    def __init__(self, lane: Any) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self.regions = {id(t): name for name, t in lane.state.region_buffers.items()}
        self.workspaces = list(lane.state.workspaces())
        self._ws = {id(t): j for j, t in enumerate(self.workspaces)}

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
            for hooks in _HOOKS:
                if getattr(mod, hooks, None):
                    raise ArtifactError(f"cadence_fx.save: {at} has {hooks}; a stored program cannot carry hooks")
            entry: dict[str, Any] = {"path": path}
            guards = _export_guards(mod)
            if isinstance(mod, GraphModule):
                entry["graph"] = _graph_enc(mod.graph, at, skip=guards)
            elif type(mod) is not torch.nn.Module:
                raise ArtifactError(f"cadence_fx.save: {at} is a {type(mod).__qualname__}; only graph modules and "
                                    f"plain containers can be stored (the program must be what the passes produced)")
            attrs = []
            for name, p in mod._parameters.items():
                attrs.append([name, "parameter", None if p is None else self.ref(p)])
            for name, b in mod._buffers.items():
                kind = "buffer" if name not in mod._non_persistent_buffers_set else "buffer_np"
                attrs.append([name, kind, None if b is None else self.ref(b)])
            for name, v in vars(mod).items():
                if name in _MODULE_INTERNALS:
                    continue
                if isinstance(v, torch.Tensor):
                    attrs.append([name, "attribute", self.ref(v)])
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


# ---------------------------------------------------------------------- graphs
def _graph_enc(graph: Graph, where: str, *, skip: set[str] = frozenset()) -> dict[str, Any]:
    nodes = []
    for n in graph.nodes:
        if n.op == "call_module" and n.target in skip:
            continue
        try:
            target = _target_enc(n)
            args, kwargs = _enc(n.args), {k: _enc(x) for k, x in n.kwargs.items()}
        except ArtifactError as e:
            raise ArtifactError(f"cadence_fx.save: {where}, node {n.name!r}: {e}") from None
        meta = {}
        for k, v in n.meta.items():
            if k.startswith(_META_PREFIX):
                try:
                    meta[k] = _replay_spec_enc(v) if isinstance(v, ReplaySpec) else _enc(v)
                except ArtifactError as e:
                    raise ArtifactError(f"cadence_fx.save: {where}, node {n.name!r}, meta {k!r}: {e}") from None
        nodes.append([n.op, n.name, target, args, kwargs, meta])
    codegen = graph._codegen
    out: dict[str, Any] = {"nodes": nodes}
    if isinstance(codegen, _PyTreeCodeGen):
        info = codegen.pytree_info
        out["pytree"] = {"orig_args": list(info.orig_args),
                         "in_spec": None if info.in_spec is None else pytree.treespec_dumps(info.in_spec),
                         "out_spec": None if info.out_spec is None else pytree.treespec_dumps(info.out_spec)}
    elif type(codegen).__name__ != "CodeGen":
        raise ArtifactError(f"cadence_fx.save: {where} uses a {type(codegen).__name__}, which cannot be stored")
    return out


def _target_enc(n: Node) -> Any:
    if n.op in ("placeholder", "get_attr", "call_module", "output", "call_method"):
        return n.target
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return {"op": t._schema.name, "overload": t._overloadname}
    module, qualname = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
    if module and qualname and module.split(".")[0] in _CALLABLE_MODULES and "<" not in qualname:
        if _resolve_callable(module, qualname) is t:
            return {"fn": module, "qualname": qualname}
    raise ArtifactError(f"call target {t!r} is neither an ATen operator nor a function of {_CALLABLE_MODULES} "
                        f"that can be found again by name")


def _resolve_callable(module: str, qualname: str) -> Any:
    import importlib

    if module.split(".")[0] not in _CALLABLE_MODULES:
        raise ArtifactError(f"call target {module}.{qualname}: module not allowed in an artifact")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ArtifactError(f"call target {module}.{qualname} is not callable")
    return obj


def _target_dec(op: str, t: Any) -> Any:
    if not isinstance(t, dict):
        return t
    try:
        if "op" in t:
            ns, name = t["op"].split("::")
            return getattr(getattr(getattr(torch.ops, ns), name), t["overload"] or "default")
        return _resolve_callable(t["fn"], t["qualname"])
    except (AttributeError, ValueError, ImportError, KeyError) as e:
        raise ArtifactMismatch(f"cadence_fx.load: the artifact calls {t}, which this torch does not have ({e})") from None


def _graph_dec(spec: Mapping[str, Any], device_map: Callable[[torch.device], torch.device]) -> Graph:
    graph = Graph()
    env: dict[str, Node] = {}
    for op, name, target, args, kwargs, meta in spec["nodes"]:
        a = _dec(args, env, device_map)
        k = {key: _dec(x, env, device_map) for key, x in kwargs.items()}
        node = graph.create_node(op, _target_dec(op, target), a, k, name=name)
        if node.name != name:
            raise ArtifactError(f"cadence_fx.load: node name {name!r} came back as {node.name!r} (corrupted graph)")
        for key, v in meta.items():
            node.meta[key] = _replay_spec_dec(v) if key == REPLAY else _dec(v, env, device_map)
        env[name] = node
    if "pytree" in spec:
        p = spec["pytree"]
        load_spec = lambda s: None if s is None else pytree.treespec_loads(s)  # noqa: E731
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(p["orig_args"], load_spec(p["in_spec"]), load_spec(p["out_spec"])))
    return graph


def _replay_spec_enc(spec: ReplaySpec) -> dict[str, Any]:
    return {"ReplaySpec": {"name": spec.name, "aliased": list(spec.aliased), "readonly": list(spec.readonly),
                           "written": None if spec.written is None else list(spec.written)}}


def _replay_spec_dec(v: Any) -> ReplaySpec:
    d = v["ReplaySpec"]
    return ReplaySpec(d["name"], tuple(d["aliased"]), tuple(d["readonly"]),
                      None if d["written"] is None else tuple(d["written"]))


# ---------------------------------------------------------------------- values
_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo, torch.sparse_csr, torch._mkldnn)}  # type: ignore[attr-defined]
_FORMATS = {str(x): x for x in (torch.contiguous_format, torch.preserve_format, torch.channels_last,
                                torch.channels_last_3d)}


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ArtifactError(f"cadence_fx.load: unknown dtype {name!r}")
    return d


def _enc(v: Any) -> Any:
    """A JSON value for a graph argument, a key or a plan field; tuples, floats and torch objects tagged."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):  # a node reference is "%name": a string that starts with % is escaped
        return {"str": v} if v.startswith("%") else v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, Node):
        return "%" + v.name
    if isinstance(v, torch.dtype):
        return {"dtype": _dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v)}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v)}
    if isinstance(v, slice):
        return {"slice": [_enc(v.start), _enc(v.stop), _enc(v.step)]}
    # tuples are JSON arrays, lists are tagged: graph arguments hold tens of thousands of tuples
    if isinstance(v, tuple):  # torch.Size included: a tuple of ints to every ATen schema
        return [_enc(x) for x in v]
    if isinstance(v, list):  # immutable_list included
        return {"list": [_enc(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[_enc(k), _enc(x)] for k, x in v.items()]}
    if v is Ellipsis:
        return {"ellipsis": True}
    raise ArtifactError(f"cannot store a value of type {type(v).__name__}: {v!r}")


def _dec(v: Any, env: Mapping[str, Node] | None = None,
         device_map: Callable[[torch.device], torch.device] | None = None) -> Any:
    if isinstance(v, list):
        return tuple(_dec(x, env, device_map) for x in v)
    if isinstance(v, str) and v.startswith("%"):
        if env is None or v[1:] not in env:
            raise ArtifactError(f"cadence_fx.load: a node refers to {v[1:]!r} before it is defined (corrupted graph)")
        return env[v[1:]]
    if not isinstance(v, dict):
        return v
    (tag, x), = v.items()
    if tag == "list":
        return [_dec(y, env, device_map) for y in x]
    if tag == "str":
        return x
    if tag == "dict":
        return {_dec(k, env, device_map): _dec(y, env, device_map) for k, y in x}
    if tag == "float":
        return float(x)
    if tag == "dtype":
        return _dtype(x)
    if tag == "device":
        d = torch.device(x)
        return device_map(d) if device_map is not None else d
    if tag == "layout":
        return _LAYOUTS[x]
    if tag == "memory_format":
        return _FORMATS[x]
    if tag == "slice":
        return slice(*(_dec(y, env, device_map) for y in x))
    if tag == "ellipsis":
        return Ellipsis
    raise ArtifactError(f"cadence_fx.load: unknown value tag {tag!r} (corrupted or newer artifact)")


def _site_enc(site: RegionSite) -> dict[str, Any]:
    return {"region": site.region.name, "axis": site.axis, "shape": list(site.shape),
            "out_shape": list(site.out_shape), "dtype": _dtype_name(site.dtype), "device": str(site.device),
            "live": [list(x) for x in site.live]}


def _site_dec(d: Mapping[str, Any], contract: Contract, device: torch.device) -> RegionSite:
    return RegionSite(contract.region(d["region"]), d["axis"], tuple(d["shape"]), tuple(d["out_shape"]),
                      _dtype(d["dtype"]), device, tuple(tuple(x) for x in d["live"]))


def _facts_enc(facts: ProgramFacts) -> dict[str, Any]:
    """The JSON-able findings (counts, byte tallies, notes); region states hold nodes and are the passes' own."""
    out = {}
    for f in fields(facts):
        if f.name in ("sites", "region_buffers", "regions", "folded_weights"):
            continue
        try:
            out[f.name] = _enc(getattr(facts, f.name))
        except ArtifactError:
            continue  # a finding the runtime never reads back
    return out


def _plan_enc(plan: Plan) -> dict[str, Any]:
    return {"regions": [_enc({f.name: getattr(r, f.name) for f in fields(r)}) for r in plan.regions],
            "classes": _enc(plan.classes), "wrap": _enc(plan.wrap), "notes": _enc(plan.notes)}


def _plan_dec(d: Mapping[str, Any]) -> Plan:
    return Plan(regions=tuple(RegionPlan(**_dec(r)) for r in d["regions"]), classes=_dec(d["classes"]),
                wrap=_dec(d["wrap"]), notes=_dec(d["notes"]))


# ---------------------------------------------------------------------- contract
def _contract_enc(c: Contract) -> dict[str, Any]:
    """Everything of the contract but ``admit`` (code): its verdict per class is stored instead."""
    def retention(p: Any) -> list[Any]:
        if isinstance(p, HeadTail):
            return ["HeadTail", p.head, p.tail]
        if isinstance(p, SlidingWindow):
            return ["SlidingWindow", p.size]
        return ["Ring", p.capacity]

    return {
        "clocks": [[k.name, k.stride, k.unit] for k in c.clocks],
        "regions": [{"name": r.name, "input": r.input, "output": r.output, "clock": r.clock, "axis": r.axis,
                     "order": r.order, "retention": retention(r.retention), "initial": r.initial, "growth": r.growth,
                     "live": sorted([int(d), int(n)] for d, n in dict(r.live).items())} for r in c.regions],
        "wrap": list(c.wrap), "split_at": list(c.split_at), "admit": c.admit is not None,
        "hoist_constants": c.hoist_constants, "fold_weights": c.fold_weights,
    }


def _contract_dec(d: Mapping[str, Any]) -> Contract:
    kinds = {"HeadTail": HeadTail, "SlidingWindow": SlidingWindow, "Ring": Ring}
    regions = tuple(Region(r["name"], input=r["input"], output=r["output"], clock=r["clock"], axis=r["axis"],
                           order=r["order"], retention=kinds[r["retention"][0]](*r["retention"][1:]),
                           initial=r["initial"], growth=r["growth"], live={dd: n for dd, n in r["live"]})
                    for r in d["regions"])
    return Contract(clocks=tuple(Clock(*k) for k in d["clocks"]), regions=regions, wrap=tuple(d["wrap"]),
                    split_at=tuple(d["split_at"]), hoist_constants=d["hoist_constants"],
                    fold_weights=d["fold_weights"])


# ---------------------------------------------------------------------- devices, digests
def _program_device(lane: Any, tensors: list[torch.Tensor]) -> torch.device:
    devices = {t.device for t in list(lane.state.tensors()) + tensors if t.numel()}
    accel = {d for d in devices if d.type != "cpu"}
    if len(accel) > 1:
        raise ArtifactError(f"cadence_fx.save: the program spans devices {sorted(map(str, accel))}; an artifact "
                            f"holds a program on one device")
    return next(iter(accel)) if accel else torch.device("cpu")


def _device_enc(d: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(d) if d.type == "cuda" else d.type
    return {"type": d.type, "index": d.index if d.type != "cuda" else (d.index or 0), "name": name}


def _digests(tensors: list[torch.Tensor]) -> list[str]:
    """SHA-256 of each tensor, on a few threads (hashlib releases the GIL on large buffers)."""
    if len(tensors) < 16:
        return [sha256_tensors(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_tensors, tensors))


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


# ====================================================================== load
def load(path: str | os.PathLike[str], *, device: str | torch.device | None = None, replay: Replay | Any = "auto",
         lanes: int = 1, contract: Contract | None = None, check_weights: bool = True) -> OptimizedProgram:
    """An :class:`OptimizedProgram` from an artifact written by :func:`save`, ready for ``warmup``.

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

    Raises:
        ArtifactError: not an artifact, unreadable, or a digest differs.
        ArtifactMismatch: another torch/CUDA version, device, GPU model, kernel setting or contract.
    """
    t0 = time.perf_counter()
    _check_lanes(lanes)
    payload = _read(Path(path))
    t_read = time.perf_counter()
    manifest = _manifest(payload)
    _check_build(manifest)  # before decoding: another torch's graphs may name operators this one lacks
    stored = _contract_dec(manifest["contract"])
    if contract is not None:
        _check_contract(manifest, stored, contract)
    tensors = payload["tensors"]
    workspaces = payload["workspaces"]
    if not isinstance(tensors, list) or len(tensors) != len(manifest["tensors"]) \
            or len(workspaces) != len(manifest["workspaces"]):
        raise ArtifactError(f"cadence_fx.load: {path}: the tensor table does not match the manifest (corrupted)")
    planned = _planned_device(manifest, device)
    # Three things overlap. The device's own start-up (driver and context: seconds on a large GPU) and
    # the digest check (hashing releases the GIL) run on threads while this one decodes the graphs
    # and generates their code, which needs no device: a restarted server waits for the longest,
    # not the sum, as far as the device's start-up leaves the GIL free (load_report says). The verdict is
    # awaited before the program is handed back: a corrupted artifact still raises before any call.
    with ThreadPoolExecutor(max_workers=2) as helpers:
        started = helpers.submit(_timed, _start_device, planned) if planned.type == "cuda" else None
        verdict = helpers.submit(_timed, _check_digests, path, tensors, manifest, workspaces) if check_weights else None
        prebuilt, build_seconds = _prebuild_modules(manifest, planned)
        t_prebuilt = time.perf_counter()
        device_init_s = started.result() if started is not None else 0.0
        t_check = time.perf_counter()
        target = _check_environment(manifest, device)
        if target != planned:  # "cuda" without an index, resolved now: the device in the graphs differs
            prebuilt, build_seconds = _prebuild_modules(manifest, target)
        tensors = _place(tensors, manifest["tensors"], target)  # the checker keeps the host copies it reads
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        t_place = time.perf_counter()
        prog = _LoadedProgram(manifest, contract if contract is not None else stored, tensors, workspaces, target,
                              replay=replay, lanes=lanes, prebuilt=prebuilt, build_seconds=build_seconds)
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
                        **{f"build_{k}": v for k, v in prog._build_seconds.items()},
                        "tensor_bytes": _storage_bytes(tensors)}
    return prog


def _saved_device(manifest: Mapping[str, Any]) -> torch.device:
    """The device the artifact was optimized on."""
    dev = manifest["device"]
    return torch.device(dev["type"], dev["index"]) if dev["type"] == "cuda" else torch.device(dev["type"])


def _planned_device(manifest: Mapping[str, Any], device: str | torch.device | None) -> torch.device:
    """The device the program will go to, as far as it is known without asking the device
    (:func:`_check_environment` decides, after the device has started)."""
    target = _saved_device(manifest) if device is None else torch.device(device)
    return torch.device("cuda", 0) if target.type == "cuda" and target.index is None else target


def _device_map(saved: torch.device, target: torch.device) -> Callable[[torch.device], torch.device]:
    """Devices named in the stored graphs -> this process's: the saved CUDA device becomes ``target``."""
    def map_device(d: torch.device) -> torch.device:
        same = d.type == saved.type == "cuda" and (d.index or 0) == (saved.index or 0)
        return target if same else d
    return map_device


def _decoded_module(spec: Mapping[str, Any], map_device: Callable[[torch.device], torch.device],
                    seconds: dict[str, float]) -> GraphModule:
    """A stored graph as a GraphModule with its code generated (attributes are attached by the
    caller); the decoding and code generation seconds are added to ``seconds``."""
    t0 = time.perf_counter()
    graph = _graph_dec(spec, map_device)
    t1 = time.perf_counter()
    gm = GraphModule(torch.nn.Module(), Graph())
    gm.graph = graph  # generates and compiles its code once
    seconds["decode_s"] += t1 - t0
    seconds["codegen_s"] += time.perf_counter() - t1
    return gm


def _start_device(device: torch.device) -> None:
    """Create the device's context (the first allocation does), if this process has that device; a
    missing device is reported by :func:`_check_environment`, with the artifact's words."""
    if torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count():
        torch.empty(1, device=device)


def _prebuild_modules(manifest: Mapping[str, Any], target: torch.device
                      ) -> tuple[dict[tuple[int, str], GraphModule], dict[str, float]]:
    """Every stored graph decoded into a GraphModule with its code generated, attributes not yet set
    (the program attaches the placed tensors); keyed by (program, module path)."""
    map_device = _device_map(_saved_device(manifest), target)
    seconds = {"decode_s": 0.0, "codegen_s": 0.0}
    out = {(i, m["path"]): _decoded_module(m["graph"], map_device, seconds)
           for i, p in enumerate(manifest["programs"]) for m in p["modules"] if "graph" in m and "alias" not in m}
    return out, seconds


def _read(path: Path) -> dict[str, Any]:
    try:
        # read into memory of its own (not mmap): a later write to the file must not reach a running program
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a damaged zip
        raise ArtifactError(f"cadence_fx.load: {path} is not a readable cadence_fx artifact "
                            f"({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ArtifactError(f"cadence_fx.load: {path} is not a cadence_fx artifact (written by cadence_fx.save)")
    return payload


def _manifest(payload: Mapping[str, Any]) -> dict[str, Any]:
    text = payload.get("manifest")
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != payload.get("manifest_sha256"):
        raise ArtifactError("cadence_fx.load: the artifact's manifest does not match its SHA-256 (corrupted)")
    manifest = json.loads(text)
    if manifest.get("version") != VERSION:
        raise ArtifactMismatch(f"cadence_fx.load: artifact format version {manifest.get('version')}, this "
                               f"cadence_fx reads version {VERSION}; save it again with this version")
    return manifest


def _check_build(manifest: Mapping[str, Any]) -> None:
    """ArtifactMismatch when the artifact comes from another torch or CUDA build (asks no device)."""
    built = manifest["torch"], manifest["cuda"]
    if built != (torch.__version__, torch.version.cuda):
        raise ArtifactMismatch(
            f"cadence_fx.load: the artifact was built with torch {built[0]} (CUDA {built[1]}), this process runs "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}); kernels and hence bits may differ: optimize "
            f"again under this torch and save")


def _check_environment(manifest: Mapping[str, Any], device: str | torch.device | None) -> torch.device:
    """The device to load on; ArtifactMismatch when the bits would not be this device's (the build is
    checked first, by :func:`_check_build`)."""
    dev = manifest["device"]
    saved = _saved_device(manifest)
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
    diffs = [(k, v, _KERNEL_SETTINGS[k][0]()) for k, v in manifest["settings"].items()
             if k in _KERNEL_SETTINGS and _KERNEL_SETTINGS[k][0]() != v]
    if diffs:
        fixes = "; ".join(_KERNEL_SETTINGS[k][1].format(v=v) for k, v, _now in diffs)
        raise ArtifactMismatch(
            "cadence_fx.load: kernel settings differ from the ones the artifact was built under ("
            + ", ".join(f"{k}: saved {v}, now {now}" for k, v, now in diffs)
            + f"); the stored constants and the stock program's bits depend on them. Set: {fixes}")
    return target


def _check_contract(manifest: Mapping[str, Any], stored: Contract, given: Contract) -> None:
    mine, theirs = _contract_enc(given), manifest["contract"]
    for key in theirs:
        if key == "admit":
            continue
        if _canonical(mine.get(key)) != _canonical(theirs[key]):
            raise ArtifactMismatch(f"cadence_fx.load: the given contract differs from the artifact's in {key!r}: "
                                   f"given {mine.get(key)!r}, stored {theirs[key]!r}")
    for i, p in enumerate(manifest["programs"]):
        values = {c.name: c.stride for c in given.clocks}
        values.update({name: s["shape"][s["axis"]] for name, s in p["sites"].items()})
        verdict = True if given.admit is None else bool(given.admit(values))
        if verdict != p["admitted"]:
            raise ArtifactMismatch(f"cadence_fx.load: the given contract's admit {'admits' if verdict else 'refuses'} "
                                   f"class {values}, which the stored program {'refuses' if verdict else 'admits'}")


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def _check_digests(path: Any, tensors: list[torch.Tensor], manifest: Mapping[str, Any],
                   workspaces: list[torch.Tensor | None]) -> None:
    got = _digests(tensors)
    for i, (want, have) in enumerate(zip((t["sha256"] for t in manifest["tensors"]), got)):
        if want != have:
            raise ArtifactError(f"cadence_fx.load: {path}: tensor {i} ({_tensor_names(manifest, i)}) does not match "
                                f"its SHA-256 (corrupted or altered artifact)")
    for j, (w, t) in enumerate(zip(manifest["workspaces"], workspaces)):
        if (t is None) != w["zero"] or (t is not None and sha256_tensors(t) != w["sha256"]):
            raise ArtifactError(f"cadence_fx.load: {path}: workspace {j} does not match its SHA-256 (corrupted)")


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds ``fn(*args)`` took (its exceptions propagate)."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _tensor_names(manifest: Mapping[str, Any], i: int) -> str:
    names = [f"{m['path'] + '.' if m['path'] else ''}{a[0]}" for p in manifest["programs"] for m in p["modules"]
             for a in m.get("attrs", ()) if a[2] == ["tensor", i]]
    return ", ".join(sorted(set(names))[:3]) or "unreferenced"


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


class _LoadedProgram(OptimizedProgram):
    """An optimized program rebuilt from an artifact: each lane's programs come from the stored graphs."""

    def __init__(self, manifest: Mapping[str, Any], contract: Contract, tensors: list[torch.Tensor],
                 workspaces: list[torch.Tensor | None], device: torch.device, *, replay: Replay | Any,
                 lanes: int, prebuilt: dict[tuple[int, str], GraphModule] | None = None,
                 build_seconds: dict[str, float] | None = None) -> None:
        self._manifest = manifest
        self._tensors = tensors
        self._stored_workspaces = workspaces
        self._device = device
        self._map_device = _device_map(_saved_device(manifest), device)
        programs = manifest["programs"]
        sites = [{name: _site_dec(s, contract, device) for name, s in p["sites"].items()} for p in programs]
        self._admitted = [bool(p["admitted"]) for p in programs]
        self._setup(contract, plan=_plan_dec(manifest["plan"]), names=list(manifest["names"]), sites=sites,
                    verify=False, replay=replay, state=bool(manifest["state_rule"]))
        self.load_report: dict[str, float] = {}
        # graphs decoded ahead (the first lane's modules); a further lane decodes its own
        self._prebuilt = dict(prebuilt or {})
        self._build_seconds = dict(build_seconds or {"decode_s": 0.0, "codegen_s": 0.0})  # summed over programs
        self._assemble(lanes)

    def _progress_label(self) -> str:
        return "cadence_fx load"

    def _admit(self, sites: dict[str, RegionSite], *, log_refusal: bool = True) -> bool:
        i = next(i for i, s in enumerate(self._sites) if s is sites)
        return self._admitted[i]

    def _rewrite(self, index: int, facts: ProgramFacts, tables: CatalogTables) -> tuple[tuple, GraphModule]:
        p = self._manifest["programs"][index]
        ws_tables = tables.workspaces

        def tensor(ref: list[Any]) -> torch.Tensor:
            kind, x = ref
            if kind == "tensor":
                return self._tensors[x]
            if kind == "region":
                return facts.region_buffers[x]
            key = ("artifact", x)  # one copy per lane, shared by the lane's programs
            if key not in ws_tables:
                w = self._manifest["workspaces"][x]
                stored = self._stored_workspaces[x]
                t = torch.zeros(w["shape"], dtype=_dtype(w["dtype"]), device=self._device) if stored is None \
                    else stored.to(self._device, copy=True)
                ws_tables[key] = SharedWorkspace(stock=None, bounds=list(w["shape"]), tensor=t)
            return ws_tables[key].tensor  # type: ignore[return-value]

        modules: dict[str, torch.nn.Module] = {}
        for m in p["modules"]:
            if "alias" in m:
                modules[m["path"]] = modules[m["alias"]]
                continue
            mod: torch.nn.Module | None = torch.nn.Module() if "graph" not in m else \
                self._prebuilt.pop((index, m["path"]), None)  # the first lane's: decoded by load
            if mod is None:  # a further lane decodes its own
                mod = _decoded_module(m["graph"], self._map_device, self._build_seconds)
            for name, kind, ref in m["attrs"]:
                t = None if ref is None else tensor(ref)
                if kind == "parameter":
                    if t is not None and not isinstance(t, torch.nn.Parameter):
                        t = torch.nn.Parameter(t, requires_grad=False)
                    mod.register_parameter(name, t)  # type: ignore[arg-type]
                elif kind in ("buffer", "buffer_np"):
                    mod.register_buffer(name, t, persistent=kind == "buffer")
                else:
                    setattr(mod, name, t)
            modules[m["path"]] = mod
            if m["path"]:
                parent, _, leaf = m["path"].rpartition(".")
                modules[parent].add_module(leaf, mod)
        root = modules[""]
        assert isinstance(root, GraphModule)
        for k, v in p["facts"].items():  # the passes' counts and notes, as optimize recorded them
            if hasattr(facts, k):
                setattr(facts, k, _dec(v))
        if p["folded"] is not None:
            fw = FoldedWeights()
            for name, idx, digest in p["folded"]:
                if idx is None:  # read only by hoisted cones: not part of the loaded program
                    continue
                t = self._tensors[idx]
                fw.sources.append((name, t, t._version))
                fw.digests[name] = digest
            facts.folded_weights = fw
        key = _dec(p["key"])
        return tuple(key), root


def iter_artifact_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stored tensors of an artifact by one of their attribute paths (for inspection)."""
    payload = _read(Path(path))
    manifest = _manifest(payload)
    for i, t in enumerate(payload["tensors"]):
        yield _tensor_names(manifest, i), t
