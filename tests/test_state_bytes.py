"""``analysis.traffic.state_bytes_written``: the bytes a call writes into a state, or an error, never a guess.

Nodes the passes insert carry no recorded value; their sizes are computed on the meta device from
their inputs' values, which may be export's fake tensors (a plain meta tensor and a fake one cannot
meet in one op, so inputs are converted first). A value that cannot be had raises ``UncountedBytes``
(``record_state_bytes`` then stores None), where it used to count as 0 bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cadence_fx.analysis.graph_io import flat_outputs
from cadence_fx.analysis.ops import aten
from cadence_fx.analysis.traffic import UncountedBytes, state_bytes_written


def _traced(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_recorded_values_count_the_cat():
    gm = _traced(lambda s, x: torch.cat([s, x * 2], 1), torch.zeros(2, 6, 4), torch.zeros(2, 1, 4))
    (value,) = flat_outputs(gm.graph)
    assert state_bytes_written(gm.graph, value) == 2 * 7 * 4 * 4


def test_an_inserted_move_of_a_buffer_and_a_recorded_value_is_counted():
    # the cat a pass inserts reads a module buffer (no recorded value) and a traced value (a fake tensor)
    gm = _traced(lambda x: x * 2, torch.zeros(2, 1, 4))
    gm.register_buffer("buf", torch.zeros(2, 6, 4, dtype=torch.float32))
    graph = gm.graph
    out = graph.output_node()
    (mul,) = flat_outputs(graph)
    with graph.inserting_before(out):
        buf = graph.get_attr("buf")
        cat = graph.call_function(aten.cat.default, ([buf, mul], 1))
    assert "val" not in cat.meta and isinstance(mul.meta["val"], torch.Tensor)
    assert state_bytes_written(graph, cat) == 2 * 7 * 4 * 4


def _unknown(x: torch.Tensor) -> torch.Tensor:  # not an ATen op: nothing can size its result
    return x


def test_a_value_it_cannot_size_raises_instead_of_counting_zero():
    gm = _traced(lambda x: x * 2, torch.zeros(2, 3))
    graph = gm.graph
    out = graph.output_node()
    (mul,) = flat_outputs(graph)
    with graph.inserting_before(out):
        opaque = graph.call_function(_unknown, (mul,))
        cat = graph.call_function(aten.cat.default, ([mul, opaque],))
    with pytest.raises(UncountedBytes, match="not an ATen op"):
        state_bytes_written(graph, cat)
