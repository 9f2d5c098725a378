"""Every contract error names the field and says what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cadence_fx as cf
from cadence_fx.demo_model import DemoConfig, StreamingDecoder, demo_contract, export_catalog

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


@pytest.mark.parametrize("pol,msg", [(cf.HeadTail(0, 0), "must keep"), (cf.SlidingWindow(0), "must be positive"),
                                     (cf.Ring(-1), "must be positive")])
def test_impossible_retention(eps, pol, msg):
    with pytest.raises(cf.ContractError, match=msg):
        cf.plan(eps, _with_region("encoder_kv", retention=pol))


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
