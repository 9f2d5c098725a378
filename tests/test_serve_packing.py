"""A conversation's state packed into one buffer (checkpoints, moves) and handed off on one GPU: every bit kept."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from cadence_fx.runtime.rng import RngStates
from cadence_fx.serve.conversation import ConversationState
from cadence_fx.serve.handoff import DeviceHandoff, HandoffUnavailable, device_identity
from cadence_fx.serve.packing import ALIGN, PackLayout, pack, to_host, unpack


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"f32": torch.randn(4, 8, generator=g),
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "strided": torch.randn(4, 6, generator=g)[:, ::2],  # a view of a larger buffer
            "odd": torch.arange(7, dtype=torch.int16),  # 14 bytes: the next region starts aligned anyway
            "f64": torch.randn(2, 3, generator=g, dtype=torch.float64).t(),  # transposed
            "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
            "empty": torch.empty(0, 3)}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def test_pack_keeps_every_bit_dtype_and_shape_and_aligns_each_region():
    state = _state()
    flat, layout = pack(state)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    assert all(offset % ALIGN == 0 for *_, offset in layout.entries)
    assert layout.region_bytes() == sum(t.numel() * t.element_size() for t in state.values())
    back = unpack(flat, layout)
    assert list(back) == list(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert np.array_equal(_bits(back[name]), _bits(t)), name
    assert to_host(flat) is flat  # already on the host: no copy


def test_unpack_refuses_a_buffer_that_is_not_a_packed_one():
    flat, layout = pack(_state())
    with pytest.raises(ValueError, match="flat uint8 buffer of at least"):
        unpack(flat[:-ALIGN], layout)
    with pytest.raises(ValueError, match="flat uint8 buffer"):
        unpack(flat.view(torch.int16), layout)


def test_a_packed_state_crosses_pickle_as_one_out_of_band_array_bit_for_bit():
    state = _state()
    flat, layout = pack(state)
    cs = ConversationState.of_packed("c", flat, layout, RngStates(torch.get_rng_state(), None), next_seq=5, seed=9)
    buffers: list = []
    data = pickle.dumps(cs, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == layout.nbytes  # the whole state, one buffer
    assert len(data) < 8 << 10  # the stream holds the layout and the random streams, not the regions
    back = pickle.loads(data, buffers=buffers)
    assert back.nbytes() == cs.nbytes() == layout.region_bytes()
    for name, t in state.items():
        assert back.state[name].dtype == t.dtype and back.state[name].shape == t.shape
        assert np.array_equal(_bits(back.state[name]), _bits(t)), name
    assert torch.equal(back.rng_cpu, cs.rng_cpu) and (back.next_seq, back.seed) == (5, 9)
    assert back == ConversationState("c", back.state, back.rng_cpu, None, 5, 9)  # the buffer is not compared


def test_a_handoff_is_refused_on_another_device_or_off_the_gpu():
    layout = PackLayout.of({"x": torch.zeros(2)})
    h = DeviceHandoff("c", "node-a/GPU-1", layout, (), torch.get_rng_state(), None, 3, 1)
    with pytest.raises(HandoffUnavailable, match="handed off on node-a/GPU-1; this worker is on node-b/GPU-1"):
        h.open("node-b/GPU-1")
    with pytest.raises(HandoffUnavailable, match="this worker is on None"):
        h.open(None)  # a CPU worker
    assert device_identity(torch.device("cpu"), "node-a") is None


def _child_digest(queue_in, queue_out) -> None:  # a second process on the same GPU: maps, reads, answers
    from cadence_fx.determinism import sha256_tensors

    handoff, identity = queue_in.get()
    snap, mapping = handoff.open(identity)
    digest = sha256_tensors(snap.state[n] for n in sorted(snap.state))
    torch.cuda.synchronize()
    del snap, mapping
    queue_out.put(digest)


@pytest.mark.cuda
def test_a_handoff_is_mapped_by_another_process_on_the_same_gpu_bit_for_bit():
    import torch.multiprocessing as mp

    from cadence_fx.determinism import sha256_tensors
    from cadence_fx.serve.handoff import share

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda", 0)
    state = {n: t.to(dev) for n, t in _state().items()}
    flat, layout = pack(state)
    torch.cuda.synchronize()
    identity = device_identity(dev, "this-node")
    h = share("c", flat, layout, identity, RngStates(torch.get_rng_state(), None), next_seq=2, seed=4)
    ctx = mp.get_context("spawn")
    qi, qo = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_digest, args=(qi, qo))
    child.start()
    qi.put((h, identity))
    got = qo.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    assert got == sha256_tensors(state[n].cpu() for n in sorted(state))
