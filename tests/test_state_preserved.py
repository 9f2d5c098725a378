"""``StateStore.preserved`` (what warm-up runs inside): every byte of state and of the extra module
tensors is put back, whatever the block wrote; tensors whose bytes are all zero are zeroed again
instead of being copied to the host and back."""

from __future__ import annotations

import pytest
import torch

from cadence_fx.runtime import state as state_mod
from cadence_fx.runtime.state import StateStore, zero_bits


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def test_zero_bits_reads_bits_not_values():
    nan = torch.tensor([float("nan")])
    assert zero_bits([torch.zeros(4), torch.tensor([-0.0]), nan, torch.zeros(0), torch.zeros(3, dtype=torch.int64),
                      torch.tensor([0, 1], dtype=torch.int8)]) == [True, False, False, True, True, False]
    assert zero_bits([]) == []


def test_preserved_puts_back_every_byte_and_copies_only_what_is_not_all_zero(monkeypatch):
    regions = {"zeros": torch.zeros(6), "negzero": torch.full((3,), -0.0), "data": torch.arange(5.0),
               "ints": torch.zeros(4, dtype=torch.int32)}
    store = StateStore(regions)
    store.set_workspaces([torch.zeros(2, 3)])
    extra = [torch.tensor([7], dtype=torch.int64), torch.zeros(2, dtype=torch.bool)]
    everything = store.tensors() + extra
    before = [_bits(t) for t in everything]
    copied: list[int] = []
    real = state_mod.host_copy
    monkeypatch.setattr(state_mod, "host_copy", lambda t: copied.append(t.numel()) or real(t))
    with pytest.raises(RuntimeError, match="mid-block"):
        with store.preserved(extra):
            for t in everything:  # the block writes over all of it, then fails
                t.fill_(1)
            raise RuntimeError("mid-block")
    assert [_bits(t) for t in everything] == before
    # copied to the host: -0.0 (not zero bits), the arange and the counter; the all-zero ones not
    assert sorted(copied) == [1, 3, 5]
    with store.preserved(extra):
        regions["zeros"].copy_(torch.randn(6))
    assert [_bits(t) for t in everything] == before
