"""Saving an optimized catalog and loading it in a fresh process: ``cf.save(prog, path)`` / ``cf.load(path)``.

A restarted server would otherwise export the catalog and run ``optimize`` again before its first
chunk (Token2Wav at released sizes: 74 s + 21 s on an H200). Profiling ``optimize`` (Token2Wav at
reduced sizes, CPU) puts its time in graph work, not in kernels: ``ep.module()`` (unlifting, about a
third), the passes' analyses, ``split_module``, and generating and compiling each module's Python code
again after each pass; evaluating the hoisted cones is the only compute and digesting the weights
they read the only full read. So the artifact stores the *result* of the pipeline, not its input:

- every rewritten program of the catalog as it left the passes (lane 0, before any replay runner is
  installed): each module's graph (nodes, arguments, the ``cadence_*`` annotations the runtime
  reads), the module tree and which tensor each attribute is, as JSON;
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

An artifact is data, trusted like a checkpoint: its weights and graphs are the model, and a file
edited on purpose computes what its editor chose (the SHA-256 digests it carries sit beside what they
cover: they catch accidents, not edits). What :func:`load` guarantees is that it runs no code from
the file and allocates only what the file's own tensors bound:

- nothing the file holds reaches generated source or an import. torch.fx pastes node names,
  placeholder targets, attribute paths, method and keyword names and the pytree argument names into
  the Python code it generates, so these must be identifiers (and attribute and submodule targets
  must be held by the stored module tree); a call target is an operator of ``_OP_NAMESPACES`` that
  this torch's dispatcher has, or a function of ``_CALLABLES``, looked up in those tables; pytree
  specs are containers of identifier keys before torch's loader (which imports the modules an enum
  names) sees them; annotations have the kinds of ``_META_KINDS``;
- values nest at most ``_MAX_DEPTH`` levels; the workspaces and region buffers a lane allocates, and
  each stored tensor, take at most the stored tensors' bytes or ``_ALLOCATION_FLOOR``, whichever is
  larger;
- anything else malformed is :class:`ArtifactError` naming the file. To know the file is the one
  that was written, pin it: ``save`` returns its SHA-256, ``load(path, sha256=...)`` refuses another.

What a graph computes once called is not bounded: like a checkpoint's model, it may allocate what its
operators ask for.

The format is one file written by ``torch.save`` and read with ``torch.load(weights_only=True)``.
``torch.export.save`` is not used for the rewritten programs: its serializer takes functional exported
programs, and these are not (in-place writes into contract-owned buffers, partitions as submodules,
annotations); rebuilding them from the stock programs on load would cost the whole pipeline, which is
what the artifact exists to skip. Loading needs neither the model's code nor the upstream packages.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import keyword
import logging
import math
import operator
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from cadence_fx import kernel_settings
from cadence_fx.annotations import RANDOM, REPLAY, SEGMENT, WRAPPED, ReplaySpec
from cadence_fx.binding import RegionSite
from cadence_fx.contract import Clock, Contract, HeadTail, Region, Ring, SlidingWindow
from cadence_fx.determinism import sha256_tensors
from cadence_fx.passes import ProgramFacts
from cadence_fx.runtime.workspaces import CatalogTables, SharedWorkspace
from cadence_fx.runtime.weights import FoldedWeights, WeightsChanged
from cadence_fx.plan import Plan, RegionPlan
from cadence_fx.program import OptimizedProgram, Replay, check_lanes
from cadence_fx.runtime.clone import HOOKS as _HOOKS, MODULE_INTERNALS as _MODULE_INTERNALS
from cadence_fx.runtime.clone import export_guards as _export_guards
from cadence_fx.runtime.runners import RandomGuard, ReplayRunner

__all__ = ["ArtifactError", "ArtifactMismatch", "load", "save"]

FORMAT = "cadence_fx.artifact"
VERSION = 1
_META_PREFIX = "cadence_"  # node.meta keys the passes write for the runtime (cadence_fx.annotations)
log = logging.getLogger("cadence_fx")

# What a stored graph may name. Nothing from the file reaches generated source or an import: node
# names, placeholder targets and pytree argument names are ASCII identifiers, attribute and submodule
# targets dotted identifiers the stored module tree holds, and call targets come from these tables.
# - call_function, besides operators of these torch.ops namespaces that this torch's dispatcher has
#   (which refuses TorchScript-only ones such as aten::save): the Python functions the exported
#   graphs and the passes emit (the passes emit ATen operators only; cadence_fx.runtime.audit.audit is verify
#   mode's, which is not saved)
_OP_NAMESPACES = ("aten", "prims")
_REFUSED_OPS = ("aten::from_file",)  # maps the file its argument names (written through, when shared)
_CALLABLES: dict[str, Callable[..., Any]] = {"_operator.getitem": operator.getitem}
# - call_method: the tensor methods graphs call by name; exported graphs call none
_METHODS: frozenset[str] = frozenset()
# - the node.meta annotations the runtime reads (cadence_fx.annotations), each with its one kind
_META_KINDS: dict[str, type] = {WRAPPED: str, SEGMENT: int, REPLAY: ReplaySpec, RANDOM: bool}
# - pytree specs (in_spec / out_spec): containers only, their dict keys identifiers
_TREESPEC_TYPES = ("builtins.tuple", "builtins.list", "builtins.dict")
# How deep a stored value (graph argument, key, plan field, pytree spec) may nest.
_MAX_DEPTH = 64
# What loading may allocate from sizes the file declares (a zero workspace is stored as a shape only,
# region buffers as the plan's shapes, a stored view may span more than its storage): each stored
# tensor's view (digesting it copies it), each input warmup makes and each session's region buffer,
# and per lane the region buffers and workspaces together, take at most the bytes of the stored
# tensors' storages (which torch.load has read, so the file carried them) or this allowance, whichever
# is larger (for programs whose state outweighs their weights). A bound from the plan's own shapes
# would bound nothing: the plan is in the same file. Token2Wav at reduced sizes: 19 MB of state a
# lane against 327 MB of tensors.
_ALLOCATION_FLOOR = 1 << 30


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
        "settings": kernel_settings.snapshot(),
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
    digest = _write_atomically(path, payload)
    size = path.stat().st_size
    log.info("cadence_fx.save: wrote %s (%d bytes, SHA-256 %s)", path, size, digest)
    return {"bytes": size, "sha256": digest, "tensors": len(tensors),
            "tensor_bytes": _storage_bytes(tensors), "programs": len(programs),
            "seconds": time.perf_counter() - t0}


def _write_atomically(path: Path, payload: dict[str, Any]) -> str:
    """``torch.save`` to a fresh file beside ``path``, renamed over it; the file's SHA-256.

    ``mkstemp`` creates the file exclusively (O_EXCL: no existing file or link is opened) under an
    unpredictable name, and ``os.replace`` swaps the name atomically: a crash mid-write never leaves
    a truncated artifact under the real name, and a link at ``path`` is replaced, not followed.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w+b") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # the mode a plain open() would have given it
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            digest, _n = _sha256_file(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return digest


def _umask() -> int:
    mask = os.umask(0o077)  # the restrictive one, should another thread create a file meanwhile
    os.umask(mask)
    return mask


def _sha256_file(f: Any, into: memoryview | None = None) -> tuple[str, int]:
    """SHA-256 of the rest of the open file ``f``, read in 16 MiB pieces, and how many bytes that
    was. With ``into`` the bytes are kept there, as far as it reaches (no further byte is hashed)."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(1 << 24)) if into is None else into
    n = 0
    while True:
        piece = buf if into is None else buf[n:n + (1 << 24)]
        got = f.readinto(piece) if len(piece) else 0
        if not got:
            return h.hexdigest(), n
        h.update(piece[:got])
        n += got


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
    """A graph as JSON, refused when :func:`_graph_dec` would refuse it (so a saved artifact loads)."""
    nodes = []
    for n in graph.nodes:
        if n.op == "call_module" and n.target in skip:
            continue
        try:
            target = _target_enc(n)
            _check_node(n.op, n.name, target, n.kwargs)
            args, kwargs = _enc(n.args), {k: _enc(x) for k, x in n.kwargs.items()}
        except ArtifactError as e:
            raise ArtifactError(f"cadence_fx.save: {where}, node {n.name!r}: {e}") from None
        meta = {}
        for k, v in n.meta.items():
            if k.startswith(_META_PREFIX):
                try:
                    meta[k] = _meta_enc(k, v)
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
        try:
            _pytree_dec(out["pytree"])
        except ArtifactError as e:
            raise ArtifactError(f"cadence_fx.save: {where}: {e}") from None
    elif type(codegen).__name__ != "CodeGen":
        raise ArtifactError(f"cadence_fx.save: {where} uses a {type(codegen).__name__}, which cannot be stored")
    return out


def _target_enc(n: Node) -> Any:
    if n.op != "call_function":
        return n.target  # a name: checked by _check_node
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        enc: dict[str, str] = {"op": t._schema.name, "overload": t._overloadname}
    else:
        name = next((k for k, fn in _CALLABLES.items() if fn is t), None)
        if name is None:
            raise ArtifactError(f"call target {t!r} is neither an operator of torch.ops.{{{','.join(_OP_NAMESPACES)}}} "
                                f"nor one of the functions an artifact may call ({', '.join(_CALLABLES)})")
        module, _, qualname = name.rpartition(".")
        enc = {"fn": module, "qualname": qualname}
    if _call_target(enc) is not t:
        raise ArtifactError(f"call target {t!r} is not found again by its name {enc}")
    return enc


def _identifier(s: Any) -> bool:
    """An ASCII Python identifier that is no keyword: what torch.fx may paste into source as a name."""
    return isinstance(s, str) and s.isascii() and s.isidentifier() and not keyword.iskeyword(s)


def _dotted(s: Any) -> bool:
    """A module or attribute path: identifiers and indices (``Sequential``'s ``0``; torch.fx writes
    ``getattr(m, "0")`` for them)."""
    return isinstance(s, str) and all(_identifier(p) or p.isascii() and p.isdigit() for p in s.split("."))


def _check_node(op: Any, name: Any, target: Any, kwargs: Mapping[Any, Any]) -> None:
    """Refuse a node whose name, target or keyword names are not plain names: torch.fx pastes node
    names, placeholder targets, attribute paths, method names and keyword names into the Python
    source it generates for the module (the call targets themselves become globals of that code)."""
    if not _identifier(name):
        raise ArtifactError(f"node name {name!r} is not an identifier")
    if op == "placeholder":
        ok = _identifier(target)
    elif op in ("get_attr", "call_module"):
        ok = _dotted(target)  # and held by the stored module tree: _check_modules
    elif op == "call_method":
        ok = isinstance(target, str) and target in _METHODS
    elif op == "output":
        ok = target == "output"
    elif op == "call_function":
        ok = callable(_call_target(target))
    else:
        raise ArtifactError(f"node {name!r} has op {op!r}, which is no torch.fx op")
    if not ok:
        raise ArtifactError(f"{op} target {target!r} is not allowed in an artifact (a name: an identifier path; "
                            f"a method: one of {sorted(_METHODS)})")
    bad = [k for k in kwargs if not _identifier(k)]
    if bad:
        raise ArtifactError(f"keyword argument name {bad[0]!r} is not an identifier")


def _call_target(t: Any) -> Callable[..., Any]:
    """The callable a stored ``call_function`` target names, from a table: an operator of
    ``_OP_NAMESPACES`` that this torch's dispatcher has (``_REFUSED_OPS`` aside), or a function of
    ``_CALLABLES``. Nothing is imported."""
    if isinstance(t, dict) and set(t) == {"fn", "qualname"}:
        fn = _CALLABLES.get(f"{t['fn']}.{t['qualname']}")
        if fn is None:
            raise ArtifactError(f"call target {t['fn']}.{t['qualname']} is not one of the functions an artifact may "
                                f"call ({', '.join(_CALLABLES)})")
        return fn
    if not (isinstance(t, dict) and set(t) == {"op", "overload"} and isinstance(t["op"], str)):
        raise ArtifactError(f"call target {t!r} names neither an operator nor a function")
    return _operator(t["op"], t["overload"])


@functools.lru_cache(maxsize=None)
def _operator(qualname: str, overload: Any) -> torch._ops.OpOverload:
    ns, sep, name = qualname.partition("::")
    if ns not in _OP_NAMESPACES or not sep or not _identifier(name) or not _identifier(overload) \
            or qualname in _REFUSED_OPS:
        raise ArtifactError(f"call target {qualname}.{overload} is not an operator an artifact may call (torch.ops "
                            f"namespaces {', '.join(_OP_NAMESPACES)}; not {', '.join(_REFUSED_OPS)})")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError) as e:
        raise ArtifactMismatch(f"the artifact calls {qualname}.{overload}, which this torch does not have ({e})") \
            from None
    if not isinstance(op, torch._ops.OpOverload) or op._schema.name != qualname:
        raise ArtifactError(f"call target {qualname}.{overload} is not an operator")
    try:  # TorchScript's own operators (aten::save writes a file) are not the dispatcher's
        torch._C._dispatch_find_schema_or_throw(qualname, op._schema.overload_name)
    except RuntimeError:
        raise ArtifactError(f"call target {qualname}.{overload} is a TorchScript operator, not one an exported "
                            f"program calls") from None
    return op


def _graph_dec(spec: Mapping[str, Any], device_map: Callable[[torch.device], torch.device]) -> Graph:
    """A stored graph, each node checked (:func:`_check_node`) before it joins the graph: torch.fx
    generates the module's code from it afterwards."""
    graph = Graph()
    env: dict[str, Node] = {}
    for op, name, target, args, kwargs, meta in spec["nodes"]:
        try:
            _check_node(op, name, target, kwargs)
            if name in env:
                raise ArtifactError("the name is used twice")
            a = _dec(args, env, device_map)
            k = {key: _dec(x, env, device_map) for key, x in kwargs.items()}
            if not isinstance(a, tuple) or not isinstance(meta, dict):
                raise ArtifactError("malformed arguments or annotations")
            node = graph.create_node(op, _call_target(target) if op == "call_function" else target, a, k, name=name)
            if node.name != name:
                raise ArtifactError(f"the name came back as {node.name!r} (corrupted graph)")
            node.meta.update({key: _meta_dec(key, v) for key, v in meta.items()})
        except ArtifactError as e:
            raise type(e)(f"node {name!r}: {e}") from None
        env[name] = node
    if "pytree" in spec:
        graph._codegen = _PyTreeCodeGen(_pytree_dec(spec["pytree"]))
    return graph


def _meta_enc(key: str, v: Any) -> Any:
    if key not in _META_KINDS or type(v) is not _META_KINDS[key]:
        raise ArtifactError(f"not an annotation of _META_KINDS ({', '.join(_META_KINDS)}) of its kind (add it "
                            f"there, with its decoding)")
    return _replay_spec_enc(v) if key == REPLAY else _enc(v)


def _meta_dec(key: Any, v: Any) -> Any:
    if key not in _META_KINDS:
        raise ArtifactError(f"unknown annotation {key!r} (corrupted or newer artifact)")
    out = _replay_spec_dec(v) if key == REPLAY else _dec(v)
    if type(out) is not _META_KINDS[key]:
        raise ArtifactError(f"annotation {key!r} is a {type(out).__name__}, not a {_META_KINDS[key].__name__}")
    return out


def _replay_spec_enc(spec: ReplaySpec) -> dict[str, Any]:
    return {"ReplaySpec": {"name": spec.name, "aliased": list(spec.aliased), "readonly": list(spec.readonly),
                           "written": None if spec.written is None else list(spec.written)}}


def _replay_spec_dec(v: Any) -> ReplaySpec:
    d = v["ReplaySpec"]
    if not isinstance(d["name"], str):
        raise ArtifactError("a replay spec's name is not a string")
    return ReplaySpec(d["name"], _ints(d["aliased"]), _ints(d["readonly"]),
                      None if d["written"] is None else _ints(d["written"]))


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(type(x) is int for x in v):
        raise ArtifactError(f"{v!r} is not a list of integers")
    return tuple(v)


def _shape(v: Any, what: str) -> tuple[int, ...]:
    """A shape the manifest declares: at most 64 non-negative integers."""
    if not isinstance(v, (list, tuple)) or len(v) > 64 or not all(type(x) is int and x >= 0 for x in v):
        raise ArtifactError(f"{what}: shape {v!r} is not a list of non-negative integers")
    return tuple(v)


def _pytree_dec(p: Any) -> _PyTreeInfo:
    """The pytree calling convention of a root module: torch.fx pastes the argument names (and the
    input dict's keys) into the signature it generates, and torch's own spec loader imports modules
    a spec names (enum members, defaultdict factories): only containers of identifiers pass here."""
    if not isinstance(p, dict) or set(p) != {"orig_args", "in_spec", "out_spec"}:
        raise ArtifactError("malformed pytree calling convention")
    args = p["orig_args"]
    if not isinstance(args, list) or not all(_identifier(a) for a in args):
        raise ArtifactError(f"pytree argument names {args!r} are not identifiers")
    return _PyTreeInfo(list(args), _treespec(p["in_spec"]), _treespec(p["out_spec"]))


def _treespec(s: Any) -> pytree.TreeSpec | None:
    if s is None:
        return None

    def check(node: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"} \
                or not isinstance(node["children_spec"], list):
            raise ArtifactError("malformed pytree spec")
        kind, context, children = node["type"], node["context"], node["children_spec"]
        if kind is None:
            ok = context is None and not children
        elif kind == "builtins.dict":
            keys = json.loads(context) if isinstance(context, str) else None
            ok = isinstance(keys, list) and len(keys) == len(children) and all(_identifier(k) for k in keys)
        else:
            ok = kind in _TREESPEC_TYPES and context == "null"
        if not ok:
            raise ArtifactError(f"pytree spec node {kind!r} (context {context!r}) is not a tuple, list or dict of "
                                f"identifier keys")
        for c in children:
            check(c, depth + 1)

    if not isinstance(s, str):
        raise ArtifactError("malformed pytree spec")
    protocol, schema = json.loads(s)
    if protocol != 1:
        raise ArtifactError(f"pytree spec protocol {protocol!r}, not 1")
    check(schema, 0)
    return pytree.treespec_loads(s)


# ---------------------------------------------------------------------- values
_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo, torch.sparse_csr, torch._mkldnn)}  # type: ignore[attr-defined]
_FORMATS = {str(x): x for x in (torch.contiguous_format, torch.preserve_format, torch.channels_last,
                                torch.channels_last_3d)}


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


_DTYPES = {_dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _dtype(name: str) -> torch.dtype:
    d = _DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise ArtifactError(f"unknown dtype {name!r}")
    return d


def _enc(v: Any, depth: int = 0) -> Any:
    """A JSON value for a graph argument, a key or a plan field; tuples, floats and torch objects tagged."""
    if depth > _MAX_DEPTH:
        raise ArtifactError(f"a value nested more than {_MAX_DEPTH} levels deep")
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
        return {"slice": [_enc(x, depth + 1) for x in (v.start, v.stop, v.step)]}
    # tuples are JSON arrays, lists are tagged: graph arguments hold tens of thousands of tuples
    if isinstance(v, tuple):  # torch.Size included: a tuple of ints to every ATen schema
        return [_enc(x, depth + 1) for x in v]
    if isinstance(v, list):  # immutable_list included
        return {"list": [_enc(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]}
    if v is Ellipsis:
        return {"ellipsis": True}
    raise ArtifactError(f"cannot store a value of type {type(v).__name__}: {v!r}")


def _dec(v: Any, env: Mapping[str, Node] | None = None,
         device_map: Callable[[torch.device], torch.device] | None = None, depth: int = 0) -> Any:
    """A value :func:`_enc` wrote: JSON scalars, node references, and the tagged kinds only."""
    if depth > _MAX_DEPTH:
        raise ArtifactError(f"a value nested more than {_MAX_DEPTH} levels deep")
    if isinstance(v, list):
        return tuple(_dec(x, env, device_map, depth + 1) for x in v)
    if isinstance(v, str) and v.startswith("%"):
        if env is None or v[1:] not in env:
            raise ArtifactError(f"a node refers to {v[1:]!r} before it is defined (corrupted graph)")
        return env[v[1:]]
    if not isinstance(v, dict):
        return v
    (tag, x), = v.items()
    if tag in ("list", "dict", "slice") and not isinstance(x, list) or tag in ("str", "float", "device") \
            and not isinstance(x, str):
        raise ArtifactError(f"malformed {tag} value {x!r}")
    if tag == "list":
        return [_dec(y, env, device_map, depth + 1) for y in x]
    if tag == "str":
        return x
    if tag == "dict":
        return {_dec(k, env, device_map, depth + 1): _dec(y, env, device_map, depth + 1) for k, y in x}
    if tag == "float":
        return float(x)
    if tag == "dtype":
        return _dtype(x)
    if tag == "device":
        try:
            d = torch.device(x)
        except RuntimeError:
            raise ArtifactError(f"malformed device {x!r}") from None
        return device_map(d) if device_map is not None else d
    if tag in ("layout", "memory_format"):
        kinds = _LAYOUTS if tag == "layout" else _FORMATS
        if x not in kinds:
            raise ArtifactError(f"unknown {tag} {x!r}")
        return kinds[x]
    if tag == "slice":
        return slice(*(_dec(y, env, device_map, depth + 1) for y in x))
    if tag == "ellipsis":
        return Ellipsis
    raise ArtifactError(f"unknown value tag {tag!r} (corrupted or newer artifact)")


def _site_enc(site: RegionSite) -> dict[str, Any]:
    return {"region": site.region.name, "axis": site.axis, "shape": list(site.shape),
            "out_shape": list(site.out_shape), "dtype": _dtype_name(site.dtype), "device": str(site.device),
            "live": [list(x) for x in site.live]}


def _site_dec(d: Mapping[str, Any], contract: Contract, device: torch.device) -> RegionSite:
    return RegionSite(contract.region(d["region"]), d["axis"], tuple(d["shape"]), tuple(d["out_shape"]),
                      _dtype(d["dtype"]), device, tuple(tuple(x) for x in d["live"]))


# region states hold nodes and are the passes' own; the folded weights are stored on their own
_STORED_FACTS = frozenset(f.name for f in fields(ProgramFacts)) - {"sites", "region_buffers", "regions",
                                                                    "folded_weights"}


def _facts_enc(facts: ProgramFacts) -> dict[str, Any]:
    """The JSON-able findings (counts, byte tallies, notes); region states hold nodes and are the passes' own."""
    out = {}
    for f in fields(facts):
        if f.name not in _STORED_FACTS:
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
         lanes: int = 1, contract: Contract | None = None, check_weights: bool = True,
         sha256: str | None = None) -> OptimizedProgram:
    """An :class:`OptimizedProgram` from an artifact written by :func:`save`, ready for ``warmup``.

    The artifact is data: loading runs no code from it (its graphs name only ATen operators and the
    functions of ``_CALLABLES``; nothing it holds reaches generated source or an import) and
    allocates only what its own tensors bound (``_ALLOCATION_FLOOR``). What it computes is what
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
    t0 = time.perf_counter()
    check_lanes(lanes)
    payload = _read(Path(path), sha256)
    t_read = time.perf_counter()
    with _malformed(path):  # whatever a malformed payload raises while it is decoded: ArtifactError
        manifest = _manifest(payload)
        _check_build(manifest)  # before decoding: another torch's graphs may name operators this one lacks
        stored = _contract_dec(manifest["contract"])
        if contract is not None:
            _check_contract(manifest, stored, contract)
        tensors, workspaces = payload["tensors"], payload["workspaces"]
        _check_manifest(manifest, tensors, workspaces)  # before anything is decoded or allocated
        planned = _planned_device(manifest, device)
        # Three things overlap. The device's own start-up (driver and context: seconds on a large GPU) and
        # the digest check (hashing releases the GIL) run on threads while this one decodes the graphs
        # and generates their code, which needs no device: a restarted server waits for the longest,
        # not the sum, as far as the device's start-up leaves the GIL free (load_report says). The verdict is
        # awaited before the program is handed back: a corrupted artifact still raises before any call.
        with ThreadPoolExecutor(max_workers=2) as helpers:
            started = helpers.submit(_timed, _start_device, planned) if planned.type == "cuda" else None
            verdict = helpers.submit(_timed, _check_digests, path, tensors, manifest, workspaces) \
                if check_weights else None
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
                    seconds: dict[str, float], where: str) -> GraphModule:
    """A stored graph as a GraphModule with its code generated (attributes are attached by the
    caller); the decoding and code generation seconds are added to ``seconds``."""
    t0 = time.perf_counter()
    try:
        graph = _graph_dec(spec, map_device)
    except ArtifactError as e:
        raise type(e)(f"{where}, {e}") from None
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
    out = {(i, m["path"]): _decoded_module(m["graph"], map_device, seconds, _where(i, m["path"]))
           for i, p in enumerate(manifest["programs"]) for m in p["modules"] if "graph" in m and "alias" not in m}
    return out, seconds


def _read(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """The payload ``torch.load(weights_only=True)`` reads; with ``sha256``, from the bytes that were
    hashed (the file is read once, into memory: it cannot change between the check and the parse)."""
    source: Any = path
    if sha256 is not None:
        if not (isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256.lower())):
            raise ValueError(f"cadence_fx.load: sha256 must be 64 hex digits (as cf.save returned it), got {sha256!r}")
        sha256 = sha256.lower()
        with open(path, "rb") as f:
            data = memoryview(bytearray(os.fstat(f.fileno()).st_size))
            got, n = _sha256_file(f, data)
        if got != sha256:
            raise ArtifactError(f"cadence_fx.load: {path} has SHA-256 {got}, not the pinned {sha256}: not the "
                                f"artifact that was given")
        source = _BytesReader(data[:n])
    try:
        # read into memory of its own (not mmap): a later write to the file must not reach a running program
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a damaged zip
        raise ArtifactError(f"cadence_fx.load: {path} is not a readable cadence_fx artifact "
                            f"({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ArtifactError(f"cadence_fx.load: {path} is not a cadence_fx artifact (written by cadence_fx.save)")
    return payload


class _BytesReader(io.RawIOBase):
    """A read-only file over bytes in memory, not copied (``io.BytesIO`` copies a bytearray)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self._pos, len(self._data))[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._data) - self._pos))
        b[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


def _manifest(payload: Mapping[str, Any]) -> dict[str, Any]:
    text = payload.get("manifest")
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != payload.get("manifest_sha256"):
        raise ArtifactError("cadence_fx.load: the artifact's manifest does not match its SHA-256 (corrupted)")
    try:  # NaN and infinities are tagged by the writer (allow_nan=False): a bare one is not an artifact's
        manifest = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"the manifest is not an artifact's JSON ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError("the manifest is not a JSON object")
    if manifest.get("version") != VERSION:
        raise ArtifactMismatch(f"cadence_fx.load: artifact format version {manifest.get('version')}, this "
                               f"cadence_fx reads version {VERSION}; save it again with this version")
    return manifest


def _no_constant(name: str) -> Any:
    raise ValueError(f"bare {name}")


def _check_build(manifest: Mapping[str, Any]) -> None:
    """ArtifactMismatch when the artifact comes from another torch or CUDA build (asks no device)."""
    built = manifest["torch"], manifest["cuda"]
    if built != (torch.__version__, torch.version.cuda):
        raise ArtifactMismatch(
            f"cadence_fx.load: the artifact was built with torch {built[0]} (CUDA {built[1]}), this process runs "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}); kernels and hence bits may differ: optimize "
            f"again under this torch and save")


@contextlib.contextmanager
def _malformed(path: Any) -> Iterator[None]:
    """What a malformed payload raises while it is decoded (a missing key, a mistyped or misshapen
    entry), as :class:`ArtifactError` naming the file; FileNotFoundError and the artifact's own
    errors (ArtifactMismatch included) keep their kind."""
    try:
        yield
    except ArtifactError as e:
        if str(e).startswith("cadence_fx.load"):
            raise
        raise type(e)(f"cadence_fx.load: {path}: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError) as e:
        raise ArtifactError(f"cadence_fx.load: {path}: malformed artifact ({type(e).__name__}: {e})") from e


def _where(index: int, path: str) -> str:
    return f"program {index}, module {path or '<root>'!r}"


def _check_manifest(manifest: Mapping[str, Any], tensors: Any, workspaces: Any) -> None:
    """What the payload declares, checked before anything is decoded or allocated: the tensor
    tables (dense tensors, as many as the manifest lists), the sizes loading allocates (bounded by
    the stored tensors, ``_ALLOCATION_FLOOR``), and every program's module tree and references."""
    if not isinstance(tensors, list) or not isinstance(workspaces, list) or len(tensors) != len(manifest["tensors"]) \
            or len(workspaces) != len(manifest["workspaces"]):
        raise ArtifactError("the tensor table does not match the manifest (corrupted)")
    for i, t in enumerate(tensors):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise ArtifactError(f"tensor {i} is a {type(t).__name__}, not a dense tensor")
    budget = max(_ALLOCATION_FLOOR, _storage_bytes(tensors))

    def bounded(nbytes: int, what: str) -> None:
        if nbytes > budget:
            raise ArtifactError(f"{what} takes {nbytes} bytes, more than loading this artifact may allocate "
                                f"({budget}: the larger of its tensors' {_storage_bytes(tensors)} bytes and "
                                f"{_ALLOCATION_FLOOR})")

    for i, t in enumerate(tensors):  # a view may span more than its storage (digesting copies it)
        bounded(t.numel() * t.element_size(), f"tensor {i}")
    state = 0  # what each lane allocates: region buffers and workspaces
    for j, (w, t) in enumerate(zip(manifest["workspaces"], workspaces)):
        shape, dtype = _shape(w["shape"], f"workspace {j}"), _dtype(w["dtype"])
        if t is not None and (type(t) is not torch.Tensor or tuple(t.shape) != shape or t.dtype != dtype):
            raise ArtifactError(f"workspace {j}: the stored tensor is not the {list(shape)} {dtype} the manifest "
                                f"declares")
        state += math.prod(shape) * dtype.itemsize
    programs = manifest["programs"]
    plan = _plan_dec(manifest["plan"])
    for rp in plan.regions:
        size = _dtype(programs[0]["sites"][rp.name]["dtype"]).itemsize
        state += math.prod(_shape(rp.stored_shape, f"region {rp.name!r}")) * size
        bounded(math.prod(_shape(rp.session_shape, f"region {rp.name!r}")) * size, f"a session's region {rp.name!r}")
    bounded(state, "a lane's region buffers and workspaces")
    counts = {"tensor": len(tensors), "workspace": len(workspaces)}
    regions = {rp.name for rp in plan.regions}
    for i, p in enumerate(programs):
        for arg in _dec(p["key"]):
            if arg[0] == "T":  # an input warmup may make (a zero tensor of that shape)
                if not isinstance(arg[2], torch.dtype):
                    raise ArtifactError(f"program {i}: an input's dtype is {arg[2]!r}")
                bounded(math.prod(_shape(arg[1], f"program {i}, input")) * arg[2].itemsize, f"program {i}'s input")
        for name, site in p["sites"].items():
            _shape(site["shape"], f"program {i}, site {name!r}")
            _shape(site["out_shape"], f"program {i}, site {name!r}")
        for _name, idx, _digest in p["folded"] or ():
            if idx is not None and not (type(idx) is int and 0 <= idx < len(tensors)):
                raise ArtifactError(f"program {i}: folded weight {_name!r} refers to tensor {idx!r}, not in the table")
        _check_modules(p["modules"], i, counts, regions)


_ATTR_KINDS = ("parameter", "buffer", "buffer_np", "attribute")


def _check_modules(modules: list[Mapping[str, Any]], index: int, counts: Mapping[str, int],
                   regions: set[str]) -> None:
    """A program's module tree: dotted identifier paths, each after its parent; attributes named by
    identifiers and referring to entries that exist; and every ``get_attr`` / ``call_module`` target
    of its graphs an attribute or a module that the tree holds."""
    canonical: dict[str, str] = {}  # module path -> the path of the module it is (an alias: another's)
    attrs: dict[str, set[str]] = {}
    graphs = []
    for m in modules:
        path = m["path"]
        first = path == "" and not canonical  # the root, then each module after its parent
        if not (first or _dotted(path) and path not in canonical and path.rpartition(".")[0] in canonical):
            raise ArtifactError(f"program {index}: module path {path!r} is not a dotted name after its parent's")
        if "alias" in m:
            if m["alias"] not in canonical:
                raise ArtifactError(f"program {index}: module {path!r} is an alias of {m['alias']!r}, which is not "
                                    f"stored before it")
            canonical[path] = canonical[m["alias"]]
            continue
        canonical[path] = path
        attrs[path] = set()
        for name, kind, ref in m["attrs"]:
            to = ref is None or isinstance(ref, list) and len(ref) == 2 and (
                ref[1] in regions if ref[0] == "region"
                else type(ref[1]) is int and 0 <= ref[1] < counts.get(ref[0], 0))
            if not (_identifier(name) and kind in _ATTR_KINDS and to) or name in attrs[path]:
                raise ArtifactError(f"{_where(index, path)}: attribute {name!r} ({kind!r}, {ref!r}) is not a named "
                                    f"reference to a stored tensor, workspace or region")
            attrs[path].add(name)
        if "graph" in m:
            graphs.append((path, m["graph"]))
    if "" not in attrs or not graphs or graphs[0][0] != "":
        raise ArtifactError(f"program {index}: no root graph")

    def resolve(path: str) -> str | None:
        out: str | None = ""
        for part in path.split(".") if path else ():
            out = canonical.get(f"{out}.{part}" if out else part)
            if out is None:
                break
        return out

    for path, graph in graphs:
        for op, name, target, *_rest in graph["nodes"]:
            if op not in ("get_attr", "call_module"):
                continue
            full = f"{path}.{target}" if path and isinstance(target, str) else target
            owner, _, leaf = full.rpartition(".") if _dotted(full) else ("", "", "")
            module = resolve(owner) if _dotted(full) else None
            held = module is not None and (resolve(full) is not None or op == "get_attr" and leaf in attrs[module])
            if not held:
                raise ArtifactError(f"{_where(index, path)}, node {name!r}: {op} target {target!r} is not in the "
                                    f"stored module tree")


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
    # settings unknown to this torch's table are ignored, as are the table's entries an older writer lacked
    diffs = kernel_settings.diff(manifest["settings"])
    if diffs:
        raise ArtifactMismatch(
            "cadence_fx.load: kernel settings differ from the ones the artifact was built under ("
            + ", ".join(f"{d.name}: saved {d.saved}, now {d.now}" for d in diffs)
            + "); the stored constants and the stock program's bits depend on them. Set: "
            + "; ".join(d.how for d in diffs))
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
            if "alias" in m:  # one module reached by two paths (a shared submodule): attached at both
                modules[m["path"]] = modules[m["alias"]]
                if m["path"]:
                    parent, _, leaf = m["path"].rpartition(".")
                    modules[parent].add_module(leaf, modules[m["alias"]])
                continue
            mod: torch.nn.Module | None = torch.nn.Module() if "graph" not in m else \
                self._prebuilt.pop((index, m["path"]), None)  # the first lane's: decoded by load
            if mod is None:  # a further lane decodes its own
                mod = _decoded_module(m["graph"], self._map_device, self._build_seconds, _where(index, m["path"]))
            for name, kind, ref in m["attrs"]:
                t = None if ref is None else tensor(ref)
                if kind == "parameter":
                    if t is not None and not isinstance(t, torch.nn.Parameter):
                        t = torch.nn.Parameter(t, requires_grad=False)
                    mod.register_parameter(name, t)  # type: ignore[arg-type]
                elif kind in ("buffer", "buffer_np"):
                    mod.register_buffer(name, t, persistent=kind == "buffer")
                elif hasattr(mod, name):  # a plain attribute: never one the module has (forward, graph)
                    raise ArtifactError(f"{_where(index, m['path'])}: attribute {name!r} would replace the "
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
            if k in _STORED_FACTS:
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
    with _malformed(path):
        manifest = _manifest(payload)
        named = [(_tensor_names(manifest, i), t) for i, t in enumerate(payload["tensors"])]
    yield from named
