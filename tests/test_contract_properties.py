"""Hypothesis: generated streaming models under generated contracts, a share of them wrong on purpose.

Every case either matches ``ep.module()`` bit for bit on every output of every call of a stream, or
is refused cleanly (``ContractError`` from ``optimize``; ``ContractError`` / ``CatalogMiss`` from a call,
and ``RetentionMismatch`` under ``verify=True``). Never a silent difference, never another exception.

The catalog is always exported from the model's TRUE contract (the programs are real); the contract
handed to ``optimize`` is the true one or a mutation of it (axis, order, retention sizes, policy kind,
initial extent, growth, output index, input name, swapped regions, a dropped or duplicated region,
live dims, wrap path). The true contract itself must be accepted and exact (with ``verify`` off; the
second test asks the same of ``verify=True``: the audit must not raise on a correct contract).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

import cadence_fx as cf
from tests.streaming_models import (LAYOUTS, ModelSpec, RegionSpec, StreamStep, example_args, export_catalog,
                                    true_contract)

# ---------------------------------------------------------------------------------------------- models


@st.composite
def region_specs(draw, chunk: int) -> RegionSpec:
    kind = draw(st.sampled_from(["kv", "kv", "carry"]))
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    syms, _axis = LAYOUTS[layout]
    size = {"B": draw(st.sampled_from([1, 1, 2])), "H": draw(st.integers(1, 2)), "C": draw(st.integers(1, 3))}
    dims = tuple(size[s] for s in syms)
    order = draw(st.sampled_from(["old_new", "new_old"]))
    grow = draw(st.sampled_from([1, 1, 1, 2]))
    trim = draw(st.sampled_from(["narrow", "slice", "neg"]))
    reads = draw(st.sampled_from(["full", "full", "kept"]))
    if kind == "carry":  # a conv's left context: Ring(k) with an order, or SlidingWindow(k) starting full
        k = draw(st.integers(1, 4))
        if draw(st.booleans()):
            policy, keep = ("ring", k), draw(st.sampled_from(["last", "last", "first"]))
        else:
            policy, keep = ("window", k), "last"
        readout = draw(st.sampled_from(["conv", "conv", "attn", "sum"]))
        return RegionSpec("carry", layout, dims, order, policy, initial=k, grow=grow, keep=keep, trim=trim,
                          readout=readout, reads=reads)
    g = grow * chunk
    if draw(st.booleans()):
        head = draw(st.integers(0, 4))
        tail = draw(st.integers(0 if head else 1, 4))
        policy, bound = ("headtail", head, tail), head + tail
    else:
        size = draw(st.integers(1, 6))
        policy, bound = ("window", size), size
    # a prompt anywhere from empty to past the bound; the stream reaches the bound within a few calls
    initial = draw(st.integers(0, bound + g)) if draw(st.integers(0, 4)) else 0
    readout = draw(st.sampled_from(["attn", "attn", "sum"]))
    return RegionSpec("kv", layout, dims, order, policy, initial=initial, grow=grow, trim=trim, readout=readout,
                      reads=reads)


@st.composite
def model_specs(draw) -> ModelSpec:
    chunk = draw(st.integers(1, 3))
    first = draw(region_specs(chunk))
    regions = (first,)
    n = draw(st.sampled_from(["one", "two", "twin"]))
    if n == "two":
        regions += (draw(region_specs(chunk)),)
    elif n == "twin":  # same shapes and policy: the swaps bind, only the program can tell the regions apart
        regions += (dataclasses.replace(first, order=draw(st.sampled_from(["old_new", "new_old"])),
                                        trim=draw(st.sampled_from(["narrow", "slice", "neg"]))),)
    aux = draw(st.sampled_from(["none", "none", "last", "state", "dup", "input", "mean"]))
    n_in, n_out = 1 + len(regions), 1 + len(regions) + (aux != "none")
    in_perm = tuple(draw(st.permutations(range(n_in))))
    out_perm = tuple(draw(st.permutations(range(n_out))))
    wrap = draw(st.sampled_from([(), (), ("blocks.0",), ("out",), ("inp", "out")] +
                                ([("blocks.1",), ("blocks.0", "blocks.1")] if len(regions) == 2 else [])))
    return ModelSpec(dim=draw(st.integers(2, 4)), chunk=chunk, regions=regions, aux=aux, in_perm=in_perm,
                     out_perm=out_perm, wrap=wrap, growth_clock=draw(st.booleans()),
                     seed=draw(st.integers(0, 2**16)))


# ------------------------------------------------------------------------------------------- mutations

MUTATIONS = ("axis", "order", "retention", "policy_kind", "initial", "growth", "output", "input", "swap_outputs",
             "swap_inputs", "drop_region", "duplicate_region", "live", "wrap")


def _replace_region(c: cf.Contract, i: int, **changes) -> cf.Contract:
    regions = list(c.regions)
    regions[i] = dataclasses.replace(regions[i], **changes)
    return dataclasses.replace(c, regions=tuple(regions))


def _other(draw, value: int, choices) -> int:
    opts = [v for v in choices if v != value]
    return draw(st.sampled_from(opts)) if opts else value


@st.composite
def mutated_contracts(draw, spec: ModelSpec) -> tuple[str, cf.Contract | cf.ContractError]:
    """A contract wrong on purpose (a few mutations are harmless in effect, e.g. an equivalent axis).

    The contract classes check themselves on construction: a mutation they refuse comes back as the
    ``ContractError`` it raised (a clean refusal, like one from ``optimize``).
    """
    label = ["?"]
    try:
        return _mutate(draw, spec, label)
    except cf.ContractError as e:
        return label[0], e


def _mutate(draw, spec: ModelSpec, label: list) -> tuple[str, cf.Contract]:
    c = true_contract(spec)
    two = ("swap_outputs", "swap_inputs") if len(c.regions) == 2 else ()
    kind = draw(st.sampled_from(MUTATIONS + two))  # the swaps twice as often where they apply
    label[0] = kind
    i = draw(st.integers(0, len(c.regions) - 1))
    r, rs = c.regions[i], spec.regions[i]
    g = c.growth(r)
    n_in, n_out = spec.n_in, spec.n_out
    if kind == "axis":
        axis = _other(draw, r.axis, list(range(-rs.rank - 1, rs.rank + 1)))
        return f"axis {r.axis}->{axis} on {r.name}", _replace_region(c, i, axis=axis)
    if kind == "order":
        order = "new_old" if r.order == "old_new" else "old_new"
        if isinstance(r.retention, cf.Ring) and draw(st.booleans()):
            order = None  # "never concatenated": the model does concatenate it
        return f"order {r.order}->{order} on {r.name}", _replace_region(c, i, order=order)
    if kind == "retention":
        delta = draw(st.sampled_from([-2, -1, 1, 2, g]))
        pol = r.retention
        if isinstance(pol, cf.HeadTail):
            if draw(st.booleans()):
                new = cf.HeadTail(max(pol.head + delta, 0), pol.tail)
            else:
                new = cf.HeadTail(pol.head, max(pol.tail + delta, 0))
        elif isinstance(pol, cf.SlidingWindow):
            new = cf.SlidingWindow(pol.size + delta)
        else:
            new = cf.Ring(pol.capacity + delta)
        changes = {"retention": new}
        if isinstance(new, cf.Ring) and r.initial:
            changes["initial"] = max(new.capacity, 0)  # keep a Ring's initial self-consistent
        return f"retention {pol!r}->{new!r} on {r.name}", _replace_region(c, i, **changes)
    if kind == "policy_kind":
        pol = r.retention
        b = pol.bound()
        opts = [cf.HeadTail(draw(st.integers(0, b)), 0), cf.SlidingWindow(b), cf.Ring(b),
                cf.HeadTail(1, max(b - 1, 0)), cf.SlidingWindow(b + g)]
        new = draw(st.sampled_from([p for p in opts if p != pol and p.bound() > 0] or [cf.SlidingWindow(1)]))
        changes = {"retention": new}
        if isinstance(new, cf.Ring):
            changes["initial"] = new.capacity
        return f"policy {pol!r}->{new!r} on {r.name}", _replace_region(c, i, **changes)
    if kind == "initial":
        initial = max(r.initial + draw(st.sampled_from([-g, -1, 1, g, 2 * g + 1])), 0)
        initial = draw(st.sampled_from([initial, 0])) if draw(st.integers(0, 4)) == 0 else initial
        return f"initial {r.initial}->{initial} on {r.name}", _replace_region(c, i, initial=initial)
    if kind == "growth":
        growth = _other(draw, g, [1, 2, g - 1, g + 1, 2 * g])
        growth = max(growth, 1)
        if draw(st.booleans()):  # wrong via the clock stride (every region on that clock)
            clocks = tuple(dataclasses.replace(k, stride=growth) if k.name == r.clock else k for k in c.clocks)
            c2 = dataclasses.replace(c, clocks=clocks)
            if r.growth is None:
                return f"clock {r.clock} stride {g}->{growth}", c2
            return f"growth {g}->{growth} on {r.name}", _replace_region(c2, i, growth=growth)
        return f"growth {g}->{growth} on {r.name}", _replace_region(c, i, growth=growth)
    if kind == "output":
        out = _other(draw, r.output, list(range(-n_out - 1, n_out + 1)))
        return f"output {r.output}->{out} on {r.name}", _replace_region(c, i, output=out)
    if kind == "input":
        names = [f"args_{k}" for k in range(n_in)] + ["args_9", "p_inp_weight", "x"]
        name = _other(draw, r.input, names)
        return f"input {r.input}->{name} on {r.name}", _replace_region(c, i, input=name)
    if kind in ("swap_outputs", "swap_inputs") and len(c.regions) == 2:
        a, b = c.regions
        f = "output" if kind == "swap_outputs" else "input"
        regions = (dataclasses.replace(a, **{f: getattr(b, f)}), dataclasses.replace(b, **{f: getattr(a, f)}))
        return f"{kind} of r0 and r1", dataclasses.replace(c, regions=regions)
    if kind == "drop_region" and len(c.regions) == 2:  # harmless: the region stays the program's own
        return f"drop {r.name}", dataclasses.replace(c, regions=tuple(x for x in c.regions if x is not r))
    if kind == "duplicate_region":  # the same input declared twice under two names
        dup = dataclasses.replace(r, name=r.name + "_dup")
        return f"duplicate {r.name}", dataclasses.replace(c, regions=c.regions + (dup,))
    if kind == "live":
        dims = [d for d in range(rs.rank) if d != rs.axis]
        d = draw(st.sampled_from(dims))
        size = rs.shape(1)[d]
        n = draw(st.sampled_from([size, max(size - 1, 1), size + 1]))
        return f"live {{{d}: {n}}} (dim size {size}) on {r.name}", _replace_region(c, i, live={d: n})
    if kind == "wrap":
        path = draw(st.sampled_from(["blocks.2", "block.0", "inp.q", ""]))
        return f"wrap {path!r}", dataclasses.replace(c, wrap=c.wrap + (path,))
    # a two-region mutation drawn for a one-region model: flip the order instead
    order = "new_old" if r.order == "old_new" else "old_new"
    return f"order {r.order}->{order} on {r.name}", _replace_region(c, i, order=order)


# -------------------------------------------------------------------------------------------- property

# Clean refusals. StaleState (a view of a region buffer that is not the state the last call returned) is
# the state store failing closed; a wrong output index can make the driver feed one back.
REFUSALS = (cf.ContractError, cf.CatalogMiss) + ((cf.StaleState,) if hasattr(cf, "StaleState") else ())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return type(a) is type(b) and a == b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _state_slots(spec: ModelSpec) -> list[tuple[int, int]]:
    """(input position, output position) of every state region, as the model really wires them."""
    return [(spec.in_pos(1 + i), spec.out_pos(1 + i)) for i in range(len(spec.regions))]


def _inputs(spec: ModelSpec, k: int) -> torch.Tensor:
    return torch.randn(spec.chunk, spec.dim, generator=torch.Generator().manual_seed(spec.seed + 100 + k))


def _initial_state(spec: ModelSpec) -> dict[int, torch.Tensor]:
    true = true_contract(spec)
    args = example_args(spec, {r.name: r.initial for r in true.regions}, seed=spec.seed + 1)
    return {i: args[i] for i, _ in _state_slots(spec)}


def _args(spec: ModelSpec, x: torch.Tensor, state: dict[int, torch.Tensor]) -> list:
    a: list = [None] * spec.n_in
    a[spec.in_pos(0)] = x.clone()
    for i, t in state.items():
        a[i] = t
    return a


def _stock(eps):
    """``ep.module()`` of the exported program whose static input shapes match the call (no library code)."""
    table = {}
    for ep in eps:
        phs = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        table[tuple(tuple(phs[n].meta["val"].shape) for n in ep.graph_signature.user_inputs)] = ep.module()

    def call(*args):
        with torch.no_grad():  # inference, as the optimized program runs it
            return table[tuple(tuple(a.shape) for a in args)](*args)

    return call


def reference_stream(spec: ModelSpec, eps, calls: int) -> list[list[torch.Tensor]]:
    """``ep.module()`` of the matching signature, fed its own state, call after call (outputs cloned)."""
    ref_call = _stock(eps)
    state = {i: t.clone() for i, t in _initial_state(spec).items()}
    outs = []
    for k in range(calls):
        r = [t.clone() for t in _as_list(ref_call(*_args(spec, _inputs(spec, k), state)))]
        outs.append(r)
        for i, j in _state_slots(spec):
            state[i] = r[j]
    return outs


def optimized_stream(spec: ModelSpec, eps, contract: cf.Contract, refs: list, *, verify: bool) -> str:
    """One case: "exact", or the clean refusal that ended it. AssertionError on any byte difference."""
    refusals = REFUSALS + ((cf.RetentionMismatch,) if verify else ())
    try:
        prog = cf.optimize(eps, contract, verify=verify, replay="off")
    except cf.ContractError as e:
        return f"refused by optimize: {type(e).__name__}: {e}"
    state = {i: t.clone() for i, t in _initial_state(spec).items()}
    for k, ref in enumerate(refs):
        try:
            got = _as_list(prog(*_args(spec, _inputs(spec, k), state)))
        except refusals as e:
            return f"refused at call {k}: {type(e).__name__}: {e}"
        snap = [t.clone() if isinstance(t, torch.Tensor) else t for t in got]  # read before the next call
        assert len(snap) == len(ref), f"call {k}: {len(snap)} outputs, the reference has {len(ref)}"
        for j, (a, b) in enumerate(zip(ref, snap)):
            assert _same(a, b), (
                f"SILENT DIFFERENCE at call {k}, output {j} (verify={verify}): reference {tuple(a.shape)} vs "
                f"optimized {tuple(b.shape) if isinstance(b, torch.Tensor) else b!r}"
                + (f", max abs diff {(a - b).abs().max().item()!r}"
                   if isinstance(b, torch.Tensor) and a.shape == b.shape and a.numel() else ""))
        for i, j in _state_slots(spec):
            state[i] = got[j]  # the returned object itself, as a streaming driver feeds it back
    return "exact"


_CACHE: dict = {}


def exported(spec: ModelSpec):
    """The catalog exported from the TRUE contract, and the reference stream (cached: Hypothesis replays specs)."""
    if spec not in _CACHE:
        true = true_contract(spec)
        eps = export_catalog(StreamStep(spec).eval(), true)
        _CACHE.clear()
        _CACHE[spec] = (eps, reference_stream(spec, eps, len(cf.call_classes(true)) + 3))
    return _CACHE[spec]


@st.composite
def cases(draw):
    spec = draw(model_specs())
    return spec, [draw(mutated_contracts(spec)) for _ in range(draw(st.integers(2, 3)))]


# Derandomized (the same examples on every CI run); shrinking is opt-in (CADENCE_FX_SHRINK=1), as a failing
# case shrinks for minutes and the note() lines already name the model, the contract and the call.
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if os.environ.get("CADENCE_FX_SHRINK")
                                                          else ())
_SETTINGS = dict(deadline=None, derandomize=True, phases=_PHASES, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=80, **_SETTINGS)
@given(cases())
def test_generated_contracts_are_exact_or_refused(case):
    """The issue's property: every case is bit-identical on every output of every call, or refused cleanly."""
    spec, muts = case
    note(f"spec = {spec!r}")
    eps, refs = exported(spec)
    for label, contract in [("true contract", true_contract(spec))] + muts:
        for verify in (False, True):
            if isinstance(contract, cf.ContractError):
                outcome = f"refused on construction: {contract}"
            else:
                try:
                    outcome = optimized_stream(spec, eps, contract, refs, verify=verify)
                except AssertionError as e:
                    raise AssertionError(f"{label}: {e}\ncontract = {contract!r}") from None
            note(f"{label} (verify={verify}): {outcome}")
            event(f"{label.split()[0]}: {'exact' if outcome == 'exact' else 'refused'}")
            if label == "true contract" and not verify:  # the model follows it: accepted, and exact
                assert outcome == "exact", f"the TRUE contract was refused: {outcome}"


@settings(max_examples=20, **_SETTINGS)
@given(model_specs())
def test_audit_raises_no_false_alarm_on_the_true_contract(spec):
    """``verify=True`` on the contract the model follows: exact, and no RetentionMismatch."""
    note(f"spec = {spec!r}")
    eps, refs = exported(spec)
    outcome = optimized_stream(spec, eps, true_contract(spec), refs, verify=True)
    assert outcome == "exact", f"the TRUE contract was refused under verify=True: {outcome}"
