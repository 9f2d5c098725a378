"""``propose_contract``: a contract read off a recorded stream, with the evidence for every field.

The stream is the ground truth of what the user's driver does (which output it feeds back as which
input); the eager step's values say what each state keeps; the exported graph says how the model
concatenates and writes it. A proposal is a starting point a user reads, pastes and owns: every
field comes with the sentences that justify it, and a state that fits no policy is refused.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram

from cadence_fx.binding import input_names
from cadence_fx.contract import WHOLE_STEP, Clock, Contract, ContractError, Region
from cadence_fx.plan import call_classes, region_extents
from cadence_fx.proposal.graph_facts import cats_of, mutated_buffers, node_named, placeholder, writes_of
from cadence_fx.proposal.module_buffers import BufferRegion, buffer_region, lifted_buffers
from cadence_fx.proposal.observe import Stream, buffers_kept, fed_back, normalize_calls, replay
from cadence_fx.proposal.render import region_fields, render_code, render_evidence
from cadence_fx.proposal.retention import Derived, Seen, derive_region

log = logging.getLogger("cadence_fx")

Call = Mapping[str, Any] | Sequence[Any]


@dataclass(frozen=True)
class Proposal:
    """A contract proposed from an observed stream, and why.

    Attributes:
        contract: the proposed :class:`~cadence_fx.Contract` (``wrap=(cf.WHOLE_STEP,)``).
        evidence: per region (keyed by its name), the plain sentences that justify its fields; also
            one entry per input or module buffer that was considered and not proposed, saying why.
        notes: sentences about the stream as a whole (calls, names, inputs that are fresh each call).
        pending: regions found but not constructible by this cadence_fx (their fields, the error),
            printed commented out.
    """

    contract: Contract
    evidence: Mapping[str, list[str]]
    notes: tuple[str, ...] = ()
    pending: tuple[tuple[Mapping[str, Any], str], ...] = field(default_factory=tuple)

    def code(self) -> str:
        """The contract as Python: ``import cadence_fx as cf`` then ``contract = cf.Contract(...)``."""
        return render_code(self.contract, self.pending)

    def __str__(self) -> str:
        return self.code() + "\n" + render_evidence(self.evidence, self.notes)


def propose_contract(step: torch.nn.Module, calls: Sequence[Call], *, clock: str = "frame") -> Proposal:
    """Propose a native-clock contract for ``step`` from a stream recorded with it.

    ``calls``: at least 3 calls of a real stream, each a dict (input name -> value, in ``forward``'s
    order; passed by keyword, and exported with ``kwargs=``, where the names skip some of its
    parameters) or a tuple (positional), in which the driver fed each call's state outputs back as the
    next call's state inputs (record clones if the step writes its inputs in place). The step's
    module buffers must be as they were at the first call; they are restored when this returns.

    An input of call k+1 that is ``torch.equal`` to an output of call k at every k is a state region;
    its clock axis, growth, order and retention are derived and checked by values (see
    :class:`Proposal` ``.evidence``). Module buffers the step writes in place and reads back are
    proposed as ``Region(input=<buffer name>, output=None)``. Raises ContractError for a state that
    fits no retention policy.

    Example::

        calls, cache = [], torch.zeros(1, 4, 8)
        for k in range(6):
            x = torch.randn(1, 2, 8)
            calls.append({"x": x, "cache": cache})
            y, cache = step(x, cache)                  # the driver feeds the state back
        proposal = cf.propose_contract(step, calls)
        print(proposal)                                # contract = cf.Contract(...), then the evidence
        eps = cf.export_catalog(step, proposal.contract, calls[0])
    """
    stream = normalize_calls(step, calls)
    notes = [f"{stream.calls} calls observed; the step was exported on calls[0] and run eagerly on every "
             "call (under torch.no_grad, on clones of the recorded inputs"
             f"{', by keyword' if stream.by_keyword else ''})"]
    ep = _export(step, stream, 0, notes)
    names = input_names(ep)
    if len(names) != len(stream.keys):
        raise ContractError(f"propose_contract: the exported program has inputs {names}, the calls have "
                            f"{len(stream.keys)} ({stream.keys})")
    if stream.keys != names:
        notes.append(f"the calls name the inputs {stream.keys}; the exported program names them {names}, which the "
                     "contract uses (key the example passed to cf.export_catalog by them)")
    buffers = mutated_buffers(ep)
    tensors = [i for i, v in enumerate(stream.inputs[0]) if isinstance(v, torch.Tensor)]
    replay(step, stream, tensors, list(buffers))
    found, not_fed = fed_back(stream)
    evidence: dict[str, list[str]] = {}
    fresh = [names[i] for i in tensors if i not in not_fed and i not in {f.input for f in found}]
    if fresh:
        notes.append(f"inputs {fresh} are fresh every call (no output of the previous call has their shape and "
                     "dtype): not state")
    derived: dict[str, tuple[int, Derived]] = {}
    later: dict[int, ExportedProgram] = {}  # programs exported on a later call, by call
    for f in found:
        name = names[f.input]
        graph, said = _graph_of(step, stream, ep, later, name, f.input, notes)
        derived[name] = (f.output, _derive(graph, stream, name, f.input, f.output))
        evidence[name] = [_fed_sentence(name, f.output, f.also, stream.calls)] + said + list(derived[name][1].evidence)
    evidence.update({names[i]: [why] for i, why in not_fed.items()})
    held: dict[str, BufferRegion] = {}
    for fqn, (ph, writes, carried) in buffers.items():
        region, ev = buffer_region(fqn, ph, writes, carried, stream.buffers.get(fqn, []))
        name = fqn if fqn not in names else f"{fqn}_buffer"  # region names are one namespace with the inputs
        evidence[name] = ev
        if region is not None:
            held[name] = region
    contract, pending = _contract(clock, derived, held, evidence)
    _catalog_evidence(contract, names, stream, evidence, notes)
    log.info("propose_contract: %d region(s) from %d calls%s", len(contract.regions), stream.calls,
             f", {len(pending)} not constructible" if pending else "")
    return Proposal(contract, evidence, tuple(notes), tuple(pending))


def _export(step: torch.nn.Module, stream: Stream, k: int, notes: list[str]) -> ExportedProgram:
    """The step exported on call ``k`` (keyword inputs as ``kwargs=``); again with ``strict=True`` where the
    non-strict trace lifted module buffers the graph writes as constants (a buffer the step reaches through
    an object, transformers' ``StaticCache.layers[i].keys``, not through its module path)."""
    # export traces with fake tensors; the buffers are kept as found even where it would not
    with buffers_kept(step):
        try:
            ep = torch.export.export(step, *stream.call(k))
        except Exception as e:
            raise ContractError(f"propose_contract: torch.export.export of the step on calls[{k}] failed: "
                                f"{type(e).__name__}: {e}") from e
    lifted = lifted_buffers(ep, step)
    if not lifted:
        return ep
    said = (f"the non-strict torch.export lifted module buffers {sorted(lifted.values())} as constants its "
            f"graph writes (graph_signature inputs {sorted(lifted)}): the step reaches them through an "
            "object, not its module path")
    with buffers_kept(step):
        try:
            strict = torch.export.export(step, *stream.call(k), strict=True)
        except Exception as e:  # noqa: BLE001 - the non-strict program still shows the user inputs
            notes.append(f"{said}; torch.export.export(strict=True) failed too ({type(e).__name__}: {e}), so no "
                         "region is proposed for them")
            return ep
    notes.append(f"{said}; the step was exported again with strict=True, which traces them as the buffers")
    return strict


def _graph_of(step: torch.nn.Module, stream: Stream, ep: ExportedProgram, later: dict[int, ExportedProgram],
              name: str, i: int, notes: list[str]) -> tuple[ExportedProgram, list[str]]:
    """The program whose graph shows state input ``i``: ``ep``, or, where the state is empty at calls[0] and
    that graph never reads it (a context there is none of before the first call), the step exported on
    the first call at which it is not empty."""
    ph = placeholder(ep, name)
    first = stream.inputs[0][i]
    if ph is None or ph.users or first.numel():
        return ep, []
    k = next((k for k in range(1, stream.calls) if stream.inputs[k][i].numel()), None)
    if k is None:
        return ep, []
    if k not in later:
        try:
            later[k] = _export(step, stream, k, notes)
        except ContractError as e:
            return ep, [f"at calls[0] {name!r} is empty and the graph never reads it; exporting the step on "
                        f"calls[{k}] to read its cats failed ({e}), so only its values speak for it"]
    return later[k], [f"at calls[0] {name!r} is empty (shape {tuple(first.shape)}) and the graph never reads it; "
                      f"its cats and writes are read off the step exported on calls[{k}] (shape "
                      f"{tuple(stream.inputs[k][i].shape)})"]


def _derive(ep: ExportedProgram, stream: Stream, name: str, i: int, j: int) -> Derived:
    ph = placeholder(ep, name)
    outs = list(ep.graph_signature.user_outputs)
    out = node_named(ep, outs[j]) if j < len(outs) and isinstance(outs[j], str) else None
    seen = Seen(name, [c[i] for c in stream.inputs], [o[j] for o in stream.outputs],
                [c.get(i, []) for c in stream.cats],
                cats_of(ep, ph, out) if ph is not None else [], writes_of(ep, ph) if ph is not None else [])
    return derive_region(seen)


def _fed_sentence(name: str, j: int, also: tuple[int, ...], n: int) -> str:
    s = (f"input {name!r} of call k+1 is torch.equal (shape, dtype and values) to output {j} of call k for every "
         f"k in 0..{n - 2} ({n - 1} transitions): a state region, carried in by {name!r} and out by output {j}")
    if also:
        s += f"; outputs {list(also)} were equal too (output {j}, the first free one, is taken)"
    return s


def _stride(growths: Sequence[int | None]) -> int:
    known = [g for g in growths if g]
    return Counter(known).most_common(1)[0][0] if known else 1


def _contract(clock: str, derived: Mapping[str, tuple[int, Derived]], held: Mapping[str, BufferRegion],
              evidence: dict[str, list[str]]) -> tuple[Contract, list[tuple[dict[str, Any], str]]]:
    growths = [d.growth for _j, d in derived.values()] + [b.growth for b in held.values()]
    stride = _stride(growths)
    clocks = (Clock(clock, stride),) if derived or held else ()
    regions: list[Region] = []
    for name, (j, d) in derived.items():
        growth = d.growth if d.growth is not None and d.growth != stride else None
        regions.append(Region(name, input=name, output=j, clock=clock, axis=d.axis, order=d.order,
                              retention=d.retention, initial=d.initial, growth=growth))
        evidence[name].append(_clock_sentence(clock, stride, d.growth))
    pending: list[tuple[dict[str, Any], str]] = []
    buffer_regions: list[Region] = []
    for name, b in held.items():
        fields = b.fields(name, clock, b.growth if b.growth is not None and b.growth != stride else None)
        try:
            buffer_regions.append(Region(**fields))
            evidence[name].append(_clock_sentence(clock, stride, b.growth))
        except (ContractError, TypeError) as e:
            pending.append((fields, f"{type(e).__name__}: {e}"))
            evidence[name].append(f"not proposed: this cadence_fx does not construct Region(output=None) yet "
                                 f"({type(e).__name__}: {e}); printed commented out")
    try:
        return Contract(clocks, tuple(regions + buffer_regions), wrap=(WHOLE_STEP,)), pending
    except ContractError as e:
        if not buffer_regions:
            raise
        for r in buffer_regions:  # the contract refuses them together: keep the rest of the proposal
            pending.append((region_fields(r), f"ContractError: {e}"))
            evidence[r.name].append(f"not proposed: Contract refused the module-buffer regions ({e})")
        return Contract(clocks, tuple(regions), wrap=(WHOLE_STEP,)), pending


def _clock_sentence(clock: str, stride: int, growth: int | None) -> str:
    if growth is None:
        return f"clock {clock!r} (stride {stride}): nothing is appended to it, so it follows the clock"
    if growth == stride:
        return f"clock {clock!r} has stride {stride}: the most common growth among the regions, this one's too"
    return f"growth={growth}: the clock {clock!r} advances {stride} (the most common growth), this region {growth}"


def _catalog_evidence(contract: Contract, names: Sequence[str], stream: Stream,
                      evidence: dict[str, list[str]], notes: list[str]) -> None:
    classes = call_classes(contract)
    if classes and contract.regions:
        notes.append(f"catalog: {len(classes)} signature class(es), {classes} (cf.call_classes); "
                     "cf.export_catalog exports one program per class")
    for r in contract.regions:
        ext = region_extents(r, contract.growth(r))
        sentence = f"catalog: input extents {ext} (cf.region_extents)"
        if r.input in names:  # a user input: its observed extents must be the ones the contract visits
            seen = [int(c[names.index(r.input)].shape[r.axis]) for c in stream.inputs]
            want = [ext[min(k, len(ext) - 1)] for k in range(len(seen))]
            sentence += ("; the observed input extents follow them" if seen == want else
                         f"; the observed input extents {seen} differ from the contract's {want}: check the proposal")
        evidence[r.name].append(sentence)
