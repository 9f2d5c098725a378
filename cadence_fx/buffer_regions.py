"""Regions kept in module buffers: lifted into the program's inputs and outputs before anything else.

A model that keeps its cache in a buffer it writes in place (gpt-fast's ``KVCache``, transformers'
``StaticCache``) exports as a program whose buffer placeholder is written (``index_copy_``, a slice
assignment), or, after ``run_decompositions``, as a functional update returned as a
``BUFFER_MUTATION`` output. Declared as a region (``Region(input=<buffer name>, output=None)``),
the buffer becomes one more user input and its new value one more user output of a rewritten
:class:`~torch.export.ExportedProgram`, so every pass, the plan, sessions and snapshots see an
ordinary region. The optimized program feeds that input itself (the last state it returned, or the
buffer's value at export on a conversation's first call) and drops that output: the caller's
signature is the stock one (:class:`BufferRegions`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec,
                                          TensorArgument)
from torch.utils import _pytree as pytree

from cadence_fx.analysis.aliases import storage_root
from cadence_fx.analysis.ops import is_mutating, written_args
from cadence_fx.contract import Contract, ContractError

__all__ = ["BufferRegions", "lift_buffer_regions"]


@dataclass(frozen=True)
class BufferRegions:
    """The regions of a lifted catalog that the caller does not pass: where they sit, where they start.

    ``inputs``: region name -> index among the lifted program's inputs; ``outputs``: region name ->
    index among its flat outputs; ``initial``: the buffer's value at export (a conversation's first
    state); ``out_spec``: the stock program's output tree, which the visible outputs are put back into.
    """

    inputs: Mapping[str, int]
    outputs: Mapping[str, int]
    initial: Mapping[str, torch.Tensor]
    out_spec: Any
    visible_names: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.inputs)

    def flatten(self, visible: Sequence[Any], state: Mapping[str, torch.Tensor]) -> list[Any]:
        """The lifted program's inputs: the caller's, with each buffer region's current state inserted
        (``state``: the last state returned to this conversation; the initial value before its first call)."""
        if not self.inputs:
            return list(visible)
        flat: list[Any] = []
        it = iter(visible)
        slots = {i: name for name, i in self.inputs.items()}
        for i in range(len(visible) + len(slots)):
            name = slots.get(i)
            flat.append(next(it) if name is None else state.get(name, self.initial[name]))
        return flat

    def visible_outputs(self, out: Any) -> Any:
        """The stock program's outputs (its tree) from the lifted program's flat outputs."""
        if not self.outputs:
            return out
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        hidden = set(self.outputs.values())
        return pytree.tree_unflatten([t for j, t in enumerate(flat) if j not in hidden], self.out_spec)


NO_BUFFER_REGIONS = BufferRegions({}, {}, {}, None, ())


def lift_buffer_regions(eps: Sequence[ExportedProgram], contract: Contract
                        ) -> tuple[list[ExportedProgram], Contract, BufferRegions]:
    """Each program with the contract's buffer regions as user inputs and outputs, the contract those
    programs take (the regions' ``input``/``output`` renamed to the new slots), and where they sit.

    Raises :class:`ContractError` when a region names a buffer the program does not have or does not
    write (naming the buffers it writes), or programs of one catalog disagree on where they sit."""
    if not any(r.output is None for r in contract.regions):
        return list(eps), contract, NO_BUFFER_REGIONS
    lifted, regions, found = [], None, None
    for ep in eps:
        new_ep, new_regions, where = _lift(ep, contract)
        if found is not None and (where.inputs, where.outputs) != (found.inputs, found.outputs):
            raise ContractError("the exported programs of one catalog hold the buffer regions at different "
                                "input or output positions; export every class from the same module")
        lifted.append(new_ep)
        regions, found = new_regions, where
    assert regions is not None and found is not None
    return lifted, replace(contract, regions=regions), found


def _mutated_buffers(ep: ExportedProgram) -> dict[str, str]:
    """Buffer name -> placeholder name of every buffer the program writes (in place or as a mutation output)."""
    sig = ep.graph_signature
    by_placeholder = {spec.arg.name: spec.target for spec in sig.input_specs if spec.kind == InputKind.BUFFER}
    written = set(sig.buffers_to_mutate.values())
    for n in ep.graph.nodes:
        if n.op == "call_function" and is_mutating(n):
            for a in written_args(n):
                root = storage_root(a)  # a slice assignment writes a view of the buffer
                if root is not None and root.op == "placeholder" and root.name in by_placeholder:
                    written.add(by_placeholder[root.name])
    return {fqn: ph for ph, fqn in by_placeholder.items() if fqn in written}


def _lift(ep: ExportedProgram, contract: Contract) -> tuple[ExportedProgram, tuple, BufferRegions]:
    sig = ep.graph_signature
    mutated = _mutated_buffers(ep)
    buffer_regions = [r for r in contract.regions if r.output is None]
    for r in buffer_regions:
        if r.input not in mutated:
            buffers = [s.target for s in sig.input_specs if s.kind == InputKind.BUFFER]
            kind = ("a buffer the program never writes (a constant, not state)" if r.input in buffers
                    else "no buffer of the program")
            raise ContractError(f"Region {r.name!r}.input: {r.input!r} is {kind}; output=None declares a module "
                                f"buffer the program mutates, and it mutates {sorted(mutated) or 'none'}")
    gm = copy.deepcopy(ep.graph_module)
    graph = gm.graph
    phs = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    out_node = graph.output_node()
    out_vals = list(out_node.args[0])
    args_spec, kwargs_spec = ep.call_spec.in_spec.children() if ep.call_spec.in_spec is not None else (None, None)
    n_args = args_spec.num_leaves if args_spec is not None else 0
    user_specs = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    other_specs = [s for s in sig.input_specs if s.kind != InputKind.USER_INPUT]
    lifted_specs, lifted_outs, names = [], [], {}
    mutation_specs = {s.target: (i, s) for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.BUFFER_MUTATION}
    dropped_out: set[int] = set()
    for r in buffer_regions:
        ph_name = mutated[r.input]
        other_specs = [s for s in other_specs if not (s.kind == InputKind.BUFFER and s.target == r.input)]
        lifted_specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(ph_name), target=None))
        if r.input in mutation_specs:  # the functional form: the new value is the mutation output
            i, _spec = mutation_specs[r.input]
            lifted_outs.append(out_vals[i])
            dropped_out.add(i)
        else:  # written in place: the placeholder itself holds the new value at the end
            lifted_outs.append(phs[ph_name])
        names[r.name] = ph_name
    # placeholders in the order of the new input specs: the lifted ones right after the positional
    # user inputs (the call passes them positionally), before any keyword input
    new_user = user_specs[:n_args] + lifted_specs + user_specs[n_args:]
    order = [s.arg.name for s in other_specs + new_user]
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for name in order:
        anchor.prepend(phs[name])
    kept_outs = [(v, s) for i, (v, s) in enumerate(zip(out_vals, sig.output_specs)) if i not in dropped_out]
    n_user_out = sum(1 for _v, s in kept_outs if s.kind == OutputKind.USER_OUTPUT)
    new_out_specs = [s for _v, s in kept_outs] + [
        OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(_out_name(v)), target=None) for v in lifted_outs]
    out_node.args = (tuple(v for v, _s in kept_outs) + tuple(lifted_outs),)
    graph.lint()
    gm.recompile()
    new_sig = ExportGraphSignature(input_specs=other_specs + new_user, output_specs=new_out_specs)
    state_dict = {k: v for k, v in ep.state_dict.items() if k not in {r.input for r in buffer_regions}}
    initial = {r.name: ep.state_dict[r.input].detach().clone() if r.input in ep.state_dict
               else ep.constants[r.input].detach().clone() for r in buffer_regions}
    # the call spec: the lifted inputs appended to the positional arguments, the outputs one flat tuple
    args_tree = pytree.tree_unflatten([0] * n_args, args_spec) if args_spec is not None else ()
    kwargs_tree = pytree.tree_unflatten([0] * kwargs_spec.num_leaves, kwargs_spec) if kwargs_spec is not None else {}
    in_spec = pytree.tree_flatten((tuple(args_tree) + (0,) * len(lifted_specs), kwargs_tree))[1]
    out_spec = pytree.tree_flatten(tuple([0] * (n_user_out + len(lifted_outs))))[1]
    entries = [ModuleCallEntry(e.fqn, replace(e.signature, in_spec=in_spec, out_spec=out_spec, forward_arg_names=None)
                               if e.fqn == "" and e.signature is not None else e.signature)
               for e in ep.module_call_graph]
    new_ep = ExportedProgram(gm, gm.graph, new_sig, state_dict, ep.range_constraints, entries,
                             constants=ep.constants, verifiers=list(ep.verifiers))
    user_names = [s.arg.name for s in new_user]
    inputs = {r.name: user_names.index(names[r.name]) for r in buffer_regions}
    outputs = {r.name: n_user_out + k for k, r in enumerate(buffer_regions)}
    by_name = {r.name: r for r in buffer_regions}
    regions = tuple(replace(r, input=names[r.name], output=outputs[r.name]) if r.name in by_name else r
                    for r in contract.regions)
    visible = tuple(s.arg.name for s in user_specs)
    return new_ep, regions, BufferRegions(inputs, outputs, initial, ep.call_spec.out_spec, visible)


def _out_name(v: Any) -> str:
    return v.name if isinstance(v, torch.fx.Node) else str(v)
