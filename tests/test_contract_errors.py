"""Every contract error names the field and says what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cadence_fx as cf
from cadence_fx.testing.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

CFG = DemoConfig()


@pytest.fixture(scope="module")
def eps():
    torch.manual_seed(0)
    model = StreamingDecoder(CFG).eval()
    return export_catalog(model, demo_contract(CFG))


def _with_region(name: str, **changes) -> cf.Contract:
    c = demo_contract(CFG)
    regions = tuple(dataclasses.replace(r, **changes) if r.name == name else r for r in c.regions)
    return dataclasses.replace(c, regions=regions)


def test_missing_input(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv'.input: 'nope' names no program input"):
        cf.optimize(eps, _with_region("encoder_kv", input="nope"))


def test_input_that_is_not_a_user_placeholder(eps):
    with pytest.raises(cf.ContractError, match=r"'b_solver_workspace' is not a user input placeholder"):
        cf.optimize(eps, _with_region("encoder_kv", input="b_solver_workspace"))


def test_axis_out_of_range(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'conv'.axis: 5 is out of range for input 'conv' of rank 3"):
        cf.optimize(eps, _with_region("conv", axis=5))


def test_unbounded_retention(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv'.retention: unbounded retention"):
        cf.optimize(eps, _with_region("encoder_kv", retention=None))


@pytest.mark.parametrize("make,msg", [
    (lambda: cf.HeadTail(0, 0), r"HeadTail\(head=0, tail=0\) needs non-negative int head and tail, not both zero"),
    (lambda: cf.HeadTail(-1, 3), r"HeadTail\(head=-1, tail=3\) needs non-negative"),
    (lambda: cf.SlidingWindow(0), r"SlidingWindow\(size=0\) needs a positive int size"),
    (lambda: cf.SlidingWindow(-2), r"SlidingWindow\(size=-2\) needs a positive int size"),
    (lambda: cf.Ring(0), r"Ring\(capacity=0\) needs a positive int capacity"),
    (lambda: cf.Ring(-1), r"Ring\(capacity=-1\) needs a positive int capacity"),
    (lambda: cf.Ring(2.5), r"Ring\(capacity=2.5\) needs a positive int capacity"),
])
def test_impossible_retention_is_refused_at_construction(make, msg):
    with pytest.raises(cf.ContractError, match=msg):
        make()


@pytest.mark.parametrize("changes,msg", [
    (dict(initial=-1), r"Region 'conv'.initial: must be a non-negative int, got -1"),
    (dict(initial=1.5), r"Region 'conv'.initial: must be a non-negative int"),
    (dict(growth=0), r"Region 'conv'.growth: must be a positive int, got 0"),
    (dict(order="sideways"), r"Region 'conv'.order: must be 'old_new' or 'new_old' \(None only for a Ring\)"),
    (dict(order=None), r"Region 'conv'.order: must be 'old_new' or 'new_old'"),
    (dict(retention=cf.Ring(4), initial=2), r"Region 'conv'.initial: a Ring region starts empty \(0\) or full \(4\)"),
    (dict(live={0: 0}), r"Region 'conv'.live\[0\]: must map a dim to a positive int"),
])
def test_region_fields_are_checked_at_construction(changes, msg):
    with pytest.raises(cf.ContractError, match=msg):
        _with_region("conv", **changes)


def test_one_input_under_two_region_names_is_refused():
    c = demo_contract(CFG)
    twin = dataclasses.replace(c.regions[0], name="encoder_kv_again", output=c.regions[1].output)
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv_again'.input: 'enc_kv' is already region "
                                               r"'encoder_kv'.s; one input or output carries one region"):
        dataclasses.replace(c, regions=c.regions + (twin,))
    twin = dataclasses.replace(c.regions[0], name="encoder_kv_again", input="noise")
    with pytest.raises(cf.ContractError, match=r"\.output: .* is already region 'encoder_kv'.s"):
        dataclasses.replace(c, regions=c.regions + (twin,))


def test_initial_extent_that_the_exported_programs_do_not_have(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv': an exported program has extent 8 on axis 1 of "
                                               r"input 'enc_kv', which the contract never reaches: its extents are "
                                               r"\[9, 13, 14\] \(initial 9.*check Region.initial"):
        cf.optimize(eps, _with_region("encoder_kv", initial=CFG.prompt + 1))


def test_order_on_a_ring_must_match_the_graph(eps):
    # the conv carry is cat([ctx, new]) then its last positions: a Ring that concatenates
    ring = cf.Ring(CFG.kernel - 1)
    cf.optimize(eps, _with_region("conv", retention=ring, initial=CFG.kernel - 1), replay="off")
    with pytest.raises(cf.ContractError, match=r"Region 'conv': declared order=None \(a Ring written in place\), but "
                                               r"node .* concatenates input 'conv'"):
        cf.optimize(eps, _with_region("conv", retention=ring, initial=CFG.kernel - 1, order=None))


def test_catalog_miss_names_the_argument_and_the_axis(eps):
    prog = cf.optimize(eps, demo_contract(CFG), replay="off")
    x = torch.zeros(1, CFG.chunk, CFG.dim)
    enc = torch.zeros(1, CFG.prompt + 1, 2 * CFG.dim)
    est = torch.zeros(CFG.slots, CFG.prompt, 2 * CFG.dim)
    conv = torch.zeros(1, CFG.dim, CFG.kernel - 1)
    with pytest.raises(cf.CatalogMiss, match=r"argument 'enc_kv': shape \(1, 9, 32\) differs on axis 1: 9 instead of 8"):
        prog(x, enc, est, conv, x)
    with pytest.raises(cf.CatalogMiss, match=r"argument 'tokens': dtype torch.float64 where torch.float32 was exported"):
        prog(x.double(), enc[:, :-1], est, conv, x)
    with pytest.raises(cf.CatalogMiss, match=r"argument 'tokens': a Python value \(int\) where a tensor was exported"):
        prog(3, enc[:, :-1], est, conv, x)


def test_wrap_path_that_matches_nothing(eps):
    c = dataclasses.replace(demo_contract(CFG), wrap=("solver.estimatr",))
    with pytest.raises(cf.ContractError, match=r"Contract.wrap: 'solver.estimatr' matches no node's nn_module_stack"):
        cf.optimize(eps, c)


def test_declared_order_differs_from_graph(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv': declared order 'new_old' but node .* "
                                               r"concatenates the cache as old_new"):
        cf.optimize(eps, _with_region("encoder_kv", order="new_old"))


def test_trim_in_graph_differs_from_policy(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv': retention in the graph does not match "
                                               r"HeadTail\(head=7, tail=7\): expected to keep \[\(0, 7\), \(9, 16\)\]"):
        cf.optimize(eps, _with_region("encoder_kv", retention=cf.HeadTail(7, 7)))


def test_extent_differs_from_policy(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'encoder_kv': the program returns 12 positions .* keeps 10"):
        cf.optimize(eps, _with_region("encoder_kv", retention=cf.SlidingWindow(10)))


def test_region_never_concatenated_on_axis(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'conv': the graph never concatenates input 'conv' along axis 1"):
        cf.optimize(eps, _with_region("conv", axis=1))


def test_duplicate_and_unknown_names(eps):
    c = demo_contract(CFG)
    with pytest.raises(cf.ContractError, match="duplicate region name"):
        cf.plan(eps, dataclasses.replace(c, regions=c.regions + (c.regions[0],)))
    with pytest.raises(cf.ContractError, match=r"no clock named 'tick'"):
        cf.plan(eps, _with_region("conv", clock="tick"))
    with pytest.raises(cf.ContractError, match="stride must be a positive int"):
        cf.Clock("frame", 0)


def test_output_index_out_of_range(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'conv'.output: index 9 out of range"):
        cf.optimize(eps, _with_region("conv", output=9))


def test_output_shape_mismatch(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'conv'.output: output 0 has shape"):
        cf.optimize(eps, _with_region("conv", output=0))


def test_live_extent_smaller_than_what_the_graph_reads(eps):
    with pytest.raises(cf.ContractError, match=r"Region 'estimator_kv'.live: the graph reads 3 of the 5 positions "
                                               r"on dim 0 of input 'est_kv', but only 2 are declared live"):
        cf.optimize(eps, _with_region("estimator_kv", live={0: 2}))
