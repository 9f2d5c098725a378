"""The graph codec: each rewritten module's FX graph as JSON and back, and the checks that make a stored
graph data.

Nothing from the file reaches generated source or an import: torch.fx pastes node names, placeholder
targets, attribute paths, method and keyword names and the pytree argument names into the Python code
it generates, so these must be identifiers (:func:`identifier`, :func:`dotted`), and attribute and
submodule targets must be held by the stored module tree (:func:`check_modules`); a call target is an
operator of ``_OP_NAMESPACES`` that this torch's dispatcher has, or a function of ``_CALLABLES``, looked
up in those tables; pytree specs are containers of identifier keys before torch's loader (which
imports the modules an enum names) sees them; annotations have the kinds of ``_META_KINDS``.
"""

from __future__ import annotations

import math

import functools
import json
import keyword
import operator
import time
from typing import AbstractSet, Any, Callable, Mapping, cast

import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from cadence_fx.annotations import META_PREFIX, RANDOM, REPLAY, SEGMENT, WRAPPED, ReplaySpec, is_journal_attr
from cadence_fx.artifact.exceptions import ArtifactError, ArtifactMismatch, where
from cadence_fx.artifact.values import DTYPE_NAMES, MAX_DEPTH, decode, encode, parse_ints

__all__ = ["check_modules", "decode_graph", "decoded_module", "dotted", "encode_graph", "identifier"]


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


def encode_graph(graph: Graph, where: str, *, skip: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    """A graph as JSON, refused when :func:`decode_graph` would refuse it (so a saved artifact loads)."""
    nodes = []
    for n in graph.nodes:
        if n.op == "call_module" and n.target in skip:
            continue
        try:
            target = _target_enc(n)
            _check_node(n.op, n.name, target, n.kwargs)
            args, kwargs = encode(n.args), {k: encode(x) for k, x in n.kwargs.items()}
        except ArtifactError as e:
            raise ArtifactError(f"cadence_fx.save: {where}, node {n.name!r}: {e}") from None
        meta = {}
        for k, v in n.meta.items():
            if k.startswith(META_PREFIX):
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


def identifier(s: Any) -> bool:
    """An ASCII Python identifier that is no keyword: what torch.fx may paste into source as a name."""
    return isinstance(s, str) and s.isascii() and s.isidentifier() and not keyword.iskeyword(s)


def dotted(s: Any) -> bool:
    """A module or attribute path: identifiers and indices (``Sequential``'s ``0``; torch.fx writes
    ``getattr(m, "0")`` for them)."""
    return isinstance(s, str) and all(identifier(p) or p.isascii() and p.isdigit() for p in s.split("."))


def _check_node(op: Any, name: Any, target: Any, kwargs: Mapping[Any, Any]) -> None:
    """Refuse a node whose name, target or keyword names are not plain names: torch.fx pastes node
    names, placeholder targets, attribute paths, method names and keyword names into the Python
    source it generates for the module (the call targets themselves become globals of that code)."""
    if not identifier(name):
        raise ArtifactError(f"node name {name!r} is not an identifier")
    if op == "placeholder":
        ok = identifier(target)
    elif op in ("get_attr", "call_module"):
        ok = dotted(target)  # and held by the stored module tree: check_modules
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
    bad = [k for k in kwargs if not identifier(k)]
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
    if ns not in _OP_NAMESPACES or not sep or not identifier(name) or not identifier(overload) \
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


def decode_graph(spec: Mapping[str, Any], device_map: Callable[[torch.device], torch.device]) -> Graph:
    """A stored graph, each node checked (:func:`_check_node`) before it joins the graph: torch.fx
    generates the module's code from it afterwards."""
    graph = Graph()
    env: dict[str, Node] = {}
    for op, name, target, args, kwargs, meta in spec["nodes"]:
        try:
            _check_node(op, name, target, kwargs)
            if name in env:
                raise ArtifactError("the name is used twice")
            a = decode(args, env, device_map)
            k = {key: decode(x, env, device_map) for key, x in kwargs.items()}
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


def decoded_module(spec: Mapping[str, Any], map_device: Callable[[torch.device], torch.device],
                    seconds: dict[str, float], where: str) -> GraphModule:
    """A stored graph as a GraphModule with its code generated (attributes are attached by the
    caller); the decoding and code generation seconds are added to ``seconds``."""
    t0 = time.perf_counter()
    try:
        graph = decode_graph(spec, map_device)
    except ArtifactError as e:
        raise type(e)(f"{where}, {e}") from None
    t1 = time.perf_counter()
    gm = GraphModule(torch.nn.Module(), Graph())
    gm.graph = graph  # generates and compiles its code once
    seconds["decode_s"] += t1 - t0
    seconds["codegen_s"] += time.perf_counter() - t1
    return gm


def _meta_enc(key: str, v: Any) -> Any:
    if key not in _META_KINDS or type(v) is not _META_KINDS[key]:
        raise ArtifactError(f"not an annotation of _META_KINDS ({', '.join(_META_KINDS)}) of its kind (add it "
                            f"there, with its decoding)")
    return _replay_spec_enc(cast(ReplaySpec, v)) if key == REPLAY else encode(v)  # its kind checked above


def _meta_dec(key: Any, v: Any) -> Any:
    if key not in _META_KINDS:
        raise ArtifactError(f"unknown annotation {key!r} (corrupted or newer artifact)")
    out = _replay_spec_dec(v) if key == REPLAY else decode(v)
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
    return ReplaySpec(d["name"], parse_ints(d["aliased"]), parse_ints(d["readonly"]),
                      None if d["written"] is None else parse_ints(d["written"]))


def _pytree_dec(p: Any) -> _PyTreeInfo:
    """The pytree calling convention of a root module: torch.fx pastes the argument names (and the
    input dict's keys) into the signature it generates, and torch's own spec loader imports modules
    a spec names (enum members, defaultdict factories): only containers of identifiers pass here."""
    if not isinstance(p, dict) or set(p) != {"orig_args", "in_spec", "out_spec"}:
        raise ArtifactError("malformed pytree calling convention")
    args = p["orig_args"]
    if not isinstance(args, list) or not all(identifier(a) for a in args):
        raise ArtifactError(f"pytree argument names {args!r} are not identifiers")
    # torch annotates the specs as TreeSpec; a root module without one has None there, as fx writes it
    return _PyTreeInfo(list(args), _treespec(p["in_spec"]), _treespec(p["out_spec"]))  # type: ignore[arg-type]


def _treespec(s: Any) -> pytree.TreeSpec | None:
    if s is None:
        return None

    def check(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"} \
                or not isinstance(node["children_spec"], list):
            raise ArtifactError("malformed pytree spec")
        kind, context, children = node["type"], node["context"], node["children_spec"]
        if kind is None:
            ok = context is None and not children
        elif kind == "builtins.dict":
            keys = json.loads(context) if isinstance(context, str) else None
            ok = isinstance(keys, list) and len(keys) == len(children) and all(identifier(k) for k in keys)
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


_ATTR_KINDS = ("parameter", "buffer", "buffer_np", "attribute")


def check_modules(modules: list[Mapping[str, Any]], index: int, counts: Mapping[str, int],
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
        if not (first or dotted(path) and path not in canonical and path.rpartition(".")[0] in canonical):
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
                else _journal_ref(name, ref[1]) if ref[0] == "journal"
                else type(ref[1]) is int and 0 <= ref[1] < counts.get(ref[0], 0))
            if not (identifier(name) and kind in _ATTR_KINDS and to) or name in attrs[path]:
                raise ArtifactError(f"{where(index, path)}: attribute {name!r} ({kind!r}, {ref!r}) is not a named "
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
            owner, _, leaf = full.rpartition(".") if dotted(full) else ("", "", "")
            module = resolve(owner) if dotted(full) else None
            held = module is not None and (resolve(full) is not None or op == "get_attr" and leaf in attrs[module])
            if not held:
                raise ArtifactError(f"{where(index, path)}, node {name!r}: {op} target {target!r} is not in the "
                                    f"stored module tree")


# a journal buffer is scratch of one call (the bytes its writes overwrite): stored as its shape and
# dtype, allocated per lane at load; bounded like any declared shape
_JOURNAL_ELEMENTS = 1 << 28


def _journal_ref(name: str, x: Any) -> bool:
    """Whether ``x`` is a journal buffer's stored form ``[id, shape, dtype]`` under a journal name."""
    if not is_journal_attr(name) or not isinstance(x, list) or len(x) != 3:
        return False
    j, shape, dtype = x
    return type(j) is int and j >= 0 and isinstance(shape, list) and len(shape) <= 64 \
        and all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) <= _JOURNAL_ELEMENTS \
        and dtype in DTYPE_NAMES
