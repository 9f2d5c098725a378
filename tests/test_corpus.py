"""Every corpus model (tests/corpus/) binds whole: exact over a stream, inside sessions with snapshot
and restore, every state declared, and no more state traffic than the unmodified program."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math

import pytest
import torch

import cadence_fx as cf
from tests.corpus import CASES, drive, load, user_lines
from tests.helpers import sha256

pytestmark = pytest.mark.corpus

_built: dict = {}


def _case(name):
    """(case, reference programs, optimized program), built once per module run."""
    if name not in _built:
        case = load(name)
        eps = case.export()
        ref_eps = copy.deepcopy(eps)  # the reference's module buffers apart from the optimized program's
        prog = cf.optimize(eps, case.contract, replay="off")
        _built[name] = (case, ref_eps, prog)
    return _built[name]


def _equal_streams(a, b):
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), f"call {k}: {len(x)} outputs against {len(y)}"
        for j, (u, v) in enumerate(zip(x, y)):
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v), f"call {k}, output {j} differs"
            else:
                assert u == v, f"call {k}, output {j} differs"


@pytest.mark.parametrize("name", CASES)
def test_stream_bit_exact(name):
    case, ref_eps, prog = _case(name)
    assert case.calls >= 12
    ref = cf.reference(ref_eps)
    # a model that keeps its state in module buffers: the reference's own buffers carry it
    want, _ = drive(ref, case, ref.catalog.names)
    got, _ = drive(prog, case, prog.input_names)
    _equal_streams(want, got)
    assert sha256([t for call in got for t in call if isinstance(t, torch.Tensor)]) == \
        sha256([t for call in want for t in call if isinstance(t, torch.Tensor)])


@pytest.mark.parametrize("name", CASES)
def test_sessions_snapshot_restore(name):
    case, _ref_eps, prog = _case(name)
    solo, _ = drive(prog.session(seed=0), case, prog.input_names)
    a, b = prog.session(seed=0), prog.session(seed=0)
    half = case.calls // 2
    out_a, st_a = drive(a, case, prog.input_names, half)
    out_b, _ = drive(b, case, prog.input_names, case.calls)  # b runs between a's calls
    snap = a.snapshot()
    rest, _ = drive(a, case, prog.input_names, case.calls - half, start=half, state=st_a)
    fed = a.restore(snap)
    state = {r.input: fed[r.name] for r in case.contract.regions if r.input in prog.input_names}
    again, _ = drive(a, case, prog.input_names, case.calls - half, start=half, state=state)
    _equal_streams(solo, out_a + rest)
    _equal_streams(rest, again)
    _equal_streams(solo, out_b)


@pytest.mark.parametrize("name", CASES)
def test_every_state_declared(name):
    case, _ref_eps, prog = _case(name)
    assert prog.undeclared_state() == {}
    assert case.contract.regions, "a streaming model with no declared state"


@pytest.mark.parametrize("name", CASES)
def test_traffic_at_most_stock_or_reported(name):
    """Per class and region, the optimized program moves no more state bytes per call than stock; where it
    does (a state the model recomputes whole, which the stock program keeps in a fresh allocation and a
    stable buffer takes one copy of), the report says so, and the excess is at most one copy of the state."""
    _case_, _ref_eps, prog = _case(name)
    report = cf.state_traffic(prog)
    assert report
    for row, (_key, entry) in zip(report, prog.catalog.items()):
        above = {f.subject for f in row["left_stock"] if f.pattern == "traffic_above_stock"}
        for region, counts in row["regions"].items():
            stock, optimized = counts["stock"], counts["optimized"]
            assert stock is not None and optimized is not None, (row["class"], region, counts)
            if optimized <= stock:
                assert region not in above
                continue
            site = entry.sites[region]
            one_copy = math.prod(site.live_out_shape) * site.dtype.itemsize
            assert region in above, (row["class"], region, counts)
            assert optimized - stock <= one_copy, (row["class"], region, counts, one_copy, row["left_stock"])


def test_traffic_report_prints_every_region():
    _case_, _ref_eps, prog = _case(CASES[0])
    text = cf.format_traffic(cf.state_traffic(prog))
    for region in prog.region_sites():
        assert region in text


@pytest.mark.parametrize("name", CASES)
def test_proposed_contract_is_accepted_and_exact(name):
    """The contract proposed from 6 recorded calls of the eager step binds and streams bit-exact."""
    case, ref_eps, _prog = _case(name)
    case.step.eval()
    names = cf.reference(ref_eps).catalog.names  # the exported inputs, in calling order
    regions = [r for r in case.contract.regions if r.output is not None]
    # a wrapper taking ``*state`` is called positionally, one with named inputs by keyword (as recorded)
    varargs = any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(case.step.forward).parameters.values())
    calls, state = [], dict(case.initial)
    with torch.no_grad():
        for k in range(6):
            given = dict(case.inputs(k))
            given.update({r.input: state[r.input] for r in regions})
            args = [given[n].clone() if isinstance(given[n], torch.Tensor) else given[n] for n in names]
            calls.append(tuple(args) if varargs else dict(zip(names, args)))
            out = case.step(*args) if varargs else case.step(**dict(zip(names, args)))
            flat = list(out) if isinstance(out, (tuple, list)) else [out]
            state = {r.input: flat[r.output] for r in regions}
    proposal = cf.propose_contract(case.step, calls)
    assert {r.input for r in case.contract.regions} <= {r.input for r in proposal.contract.regions}, str(proposal)
    first = dict(zip(names, calls[0])) if varargs else calls[0]
    eps = case.export() if any(r.output is None for r in proposal.contract.regions) else \
        cf.export_catalog(case.step, proposal.contract, first)
    ref = cf.reference(copy.deepcopy(eps))
    prog = cf.optimize(eps, proposal.contract, replay="off")
    proposed = dataclasses.replace(case, contract=proposal.contract, initial={
        r.input: first[r.input] for r in proposal.contract.regions if r.output is not None})
    want, _ = drive(ref, proposed, ref.catalog.names)
    got, _ = drive(prog, proposed, prog.input_names)
    _equal_streams(want, got)


@pytest.mark.parametrize("name", CASES)
def test_user_code_counted(name):
    assert 0 < user_lines(name) <= 60
