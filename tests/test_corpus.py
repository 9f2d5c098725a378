"""Every corpus model (tests/corpus/) binds whole: exact over a stream, inside sessions with snapshot
and restore, every state declared, and no more state traffic than the unmodified program."""

from __future__ import annotations

import copy

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
def test_traffic_at_most_stock(name):
    _case_, _ref_eps, prog = _case(name)
    report = cf.state_traffic(prog)
    assert report
    for row in report:
        for region, counts in row["regions"].items():
            assert counts["stock"] is not None and counts["optimized"] is not None, (row["class"], region, counts)
            assert counts["optimized"] <= counts["stock"], (row["class"], region, counts, row["left_stock"])


@pytest.mark.parametrize("name", CASES)
def test_user_code_counted(name):
    assert 0 < user_lines(name) <= 60
