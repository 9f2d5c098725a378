"""A further lane as a copy of the first lane's rewritten programs, instead of a second run of the passes.

The passes are deterministic functions of the exported programs and the contract, so every lane
would get the same graphs: only the tensors a lane owns differ (its region buffers and workspaces,
and the module buffers its graphs write, which :func:`~cadence_fx.runtime.lanes.privatize_written_buffers`
copies afterwards). Running the pipeline per lane spends most of ``optimize``'s time on graph work
(unlifting, analyses, code generation after each pass) that yields the same graphs again. A copy
shares lane 0's graphs and generated code (:func:`_sharing_code`) and rebinds only the tensors.

What is copied is checked, not assumed: a module that is not a plain graph module or container, a
hook, an attribute that is neither tensor nor module, or a tensor that views a lane-owned storage
without being one of the owned tensors themselves raises :class:`NotCopyable`, and the lane is built
by the passes instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _LazyGraphModule

from cadence_fx.analysis.ops import is_export_guard
from cadence_fx.runtime.workspaces import SharedWorkspace
from cadence_fx.runtime.runners import RandomGuard, ReplayRunner
from cadence_fx.runtime.state import StateStore

if TYPE_CHECKING:
    from cadence_fx.runtime.lanes import Lane

__all__ = ["MODULE_INTERNALS", "HOOKS", "NotCopyable", "copy_lane", "copy_program", "export_guards"]

# nn.Module / GraphModule attributes that hold no program data: regenerated or empty in a copy
MODULE_INTERNALS = frozenset({
    "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    # GraphModule
    "_graph", "_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec", "_tracer_cls", "_tracer_extras",
    "meta", "shape_env", "_erase_node_hooks", "_create_node_hooks", "_replace_hooks", "_deepcopy_hooks",
})
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


# a lazy graph module only defers code generation: the copy generates its code when built
_PLAIN_GRAPH_MODULES = (GraphModule, _LazyGraphModule)


class NotCopyable(Exception):
    """A rewritten program holds something a lane copy cannot reproduce; the message says what."""


def export_guards(mod: torch.nn.Module) -> set[str]:
    """The children of ``mod`` that are torch.export's input guard (:func:`~cadence_fx.analysis.ops.is_export_guard`:
    ``_guards_fn``, a generated checker of the example shapes the program was specialised to) and are
    called for no value."""
    if not isinstance(mod, GraphModule):
        return set()
    names = {name for name, child in mod._modules.items() if is_export_guard(child)}
    for n in mod.graph.nodes:
        if n.op == "call_module" and n.target in names and n.users:
            names.discard(n.target)  # its result is used: not only a check
    return names


def _plain_graph_module(mod: torch.nn.Module) -> bool:
    # torch gives every GraphModule instance a class of its own (``GraphModuleImpl``) whose base is the
    # class it was made as: only plain (or lazy) GraphModules are copied, not subclasses with state of
    # their own
    cls = type(mod)
    if cls.__qualname__.split(".")[-1] == "GraphModuleImpl":  # its __name__ is the class_name given
        cls = cls.__bases__[0]
    return cls in _PLAIN_GRAPH_MODULES


# what a graph module holds of its code, shared by a copy: the graph it was generated from, the source
# and its line map, the pytree specs and the tracer it was made with
_CODE_FIELDS = ("_graph", "_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec", "_tracer_cls",
                "_tracer_extras", "shape_env")
_HOOK_LISTS = ("_erase_node_hooks", "_create_node_hooks", "_replace_hooks", "_deepcopy_hooks")


_MODULE_FIELDS: dict[str, object] | None = None


def _bare(cls: type) -> torch.nn.Module:
    """An instance of ``cls`` holding what ``nn.Module.__init__`` gives a module (fresh empty containers,
    the default flags), without running it: ``__init__`` sets each field through a checked
    ``__setattr__`` and is most of a copy's time when a lane copies a program's thousands of modules.
    The fields are read off one module ``__init__`` built, so they follow the installed torch."""
    global _MODULE_FIELDS
    if _MODULE_FIELDS is None:
        _MODULE_FIELDS = dict(vars(torch.nn.Module()))
    new = object.__new__(cls)
    fields = vars(new)
    for name, value in _MODULE_FIELDS.items():  # the containers are empty in a module just built
        fields[name] = type(value)() if isinstance(value, (dict, set, list)) else value
    return new


def _sharing_code(mod: GraphModule) -> GraphModule:
    """An empty module of ``mod``'s own class (torch gives every graph module instance a class of its
    own, whose ``forward`` is the code generated from its graph) holding ``mod``'s graph and code: the
    lane's copy runs the same compiled code on its own attributes, with no graph copy and no code
    generation (which were most of a lane's construction time: seconds per lane for Token2Wav's step
    programs). Nothing edits a graph once its lane is built; installing a lane's runners and random
    guards rebinds attributes, and a recompile regenerates the same code from the same graph."""
    # object.__new__, not the class's: GraphModule.__new__ makes a fresh class (with no code) per call
    new = _bare(type(mod))
    fields = vars(mod)
    for name in _CODE_FIELDS:
        if name in fields:
            object.__setattr__(new, name, fields[name])
    for name in _HOOK_LISTS:
        if name in fields:
            object.__setattr__(new, name, list(fields[name]))
    new.meta = dict(mod.meta)
    return new


def copy_program(root: GraphModule, rebind: Mapping[int, torch.Tensor], owned: frozenset[int]) -> GraphModule:
    """A copy of the rewritten program ``root`` (replay runners and random guards unwrapped: the lane
    installs its own) whose graphs are copies and whose tensors are the same objects, except that a
    tensor whose ``id`` is in ``rebind`` is replaced by its value there.

    ``owned``: storage pointers of what the source lane owns. A tensor on one of them that ``rebind``
    does not replace (a view of a region buffer kept as an attribute) would be shared by both lanes:
    :class:`NotCopyable`.
    """
    done: dict[int, torch.nn.Module] = {}

    def tensor(t: torch.Tensor, at: str) -> torch.Tensor:
        if id(t) in rebind:
            return rebind[id(t)]
        if t.untyped_storage().data_ptr() in owned:
            raise NotCopyable(f"{at} views storage the lane owns without being one of its state tensors")
        return t

    def copy_module(mod: torch.nn.Module, path: str) -> torch.nn.Module:
        while isinstance(mod, (ReplayRunner, RandomGuard)):
            mod = mod.fn
        if id(mod) in done:
            return done[id(mod)]
        at = f"module {path or '<root>'!r}"
        for hooks in HOOKS:
            if getattr(mod, hooks, None):
                raise NotCopyable(f"{at} has {hooks}")
        if _plain_graph_module(mod):
            new: torch.nn.Module = _sharing_code(mod)
        elif type(mod) is torch.nn.Module:
            new = _bare(torch.nn.Module)
        else:
            raise NotCopyable(f"{at} is a {type(mod).__qualname__}; only graph modules and plain containers are copied")
        done[id(mod)] = new
        # Straight into the module's tables: every name and kind was checked when the source module
        # registered it, and the checked setters cost as much as the rest of a copy.
        fields = vars(new)
        fields["training"] = mod.training
        params = new._parameters
        for name, p in mod._parameters.items():
            if p is None:
                params[name] = None
                continue
            q = tensor(p, f"{at} parameter {name!r}")
            params[name] = q if isinstance(q, torch.nn.Parameter) else torch.nn.Parameter(q, requires_grad=False)
        buffers = new._buffers
        for name, b in mod._buffers.items():
            buffers[name] = None if b is None else tensor(b, f"{at} buffer {name!r}")
        new._non_persistent_buffers_set.update(mod._non_persistent_buffers_set)
        for name, v in vars(mod).items():
            if name in MODULE_INTERNALS:
                continue
            if not isinstance(v, torch.Tensor):
                raise NotCopyable(f"{at} holds attribute {name!r} of type {type(v).__name__}")
            fields[name] = tensor(v, f"{at} attribute {name!r}")
        guards = export_guards(mod)
        children = new._modules
        for name, child in mod._modules.items():
            if child is None or name in guards:  # a guard is a stateless checker of the example shapes: shared
                children[name] = child
            else:
                children[name] = copy_module(child, f"{path}.{name}" if path else name)
        return new

    out = copy_module(root, "")
    assert isinstance(out, GraphModule)
    return out


def copy_lane(first: "Lane", programs: Sequence[tuple[tuple, GraphModule]], store: StateStore,
              workspaces: dict[tuple, SharedWorkspace]) -> list[tuple[tuple, GraphModule]]:
    """Every program of lane ``first`` (``(key, module)`` in catalog order) copied for another lane:
    bound to ``store``'s region buffers and to clones of ``first``'s workspaces, which are added to
    ``workspaces`` (the lane's table) only when every program was copied. Raises :class:`NotCopyable`.

    The first lane has run no call when the others are built, so its workspaces still hold what the
    passes put there, which is what the passes would put in this lane's."""
    rebind = {id(t): store.region_buffer(name) for name, t in first.state.region_buffers.items()}
    clones = {}
    for j, w in enumerate(first.state.workspaces()):
        rebind[id(w)] = w.detach().clone()
        clones[("lane 0", j)] = SharedWorkspace(stock=None, bounds=list(w.shape), tensor=rebind[id(w)])
    owned = first.state.owned_storages()
    copies = [(key, copy_program(gm, rebind, owned)) for key, gm in programs]
    workspaces.update(clones)
    return copies
