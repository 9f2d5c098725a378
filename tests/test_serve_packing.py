"""A conversation's state packed into one buffer (checkpoints, moves) and handed off on one GPU: every bit kept."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence_fx.runtime.rng import RngStates
from cadence_fx.serve.conversation import ConversationState
from cadence_fx.serve.handoff import DeviceHandoff, HandoffUnavailable, device_identity
from cadence_fx.determinism import byte_view, sha256_tensors
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
    return byte_view(t).numpy() if t.numel() else np.empty(0, np.uint8)


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


def test_a_byte_view_copies_only_where_the_last_stride_is_not_one():
    strided = torch.arange(2.0)[::2]  # one element, stride 2: "contiguous", yet no byte view of it
    assert strided.is_contiguous() and strided.stride() == (2,)
    assert byte_view(strided).tolist() == list(torch.tensor([0.0]).view(torch.uint8).tolist())
    dense = torch.arange(6.0).reshape(2, 3)
    assert byte_view(dense).data_ptr() == dense.data_ptr()  # no copy
    assert byte_view(dense.t()).numel() == 24  # a transposed one is copied in row-major order
    assert torch.equal(byte_view(dense.t()), dense.t().contiguous().reshape(-1).view(torch.uint8))


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


# --------------------------------------------------------------------------- the controller's choice of path
class _Method:
    def __init__(self, log: list, name: str, result=None, error: BaseException | None = None) -> None:
        self.log, self.name, self.result, self.error = log, name, result, error

    def options(self, **_kw):
        return self

    def remote(self, *args, **kwargs):
        self.log.append(self.name)

        async def answer():
            if self.error is not None:
                raise self.error
            return self.result

        if self.name == "checkpoint":  # two returns: the state's reference (passed on, not awaited) and its header
            return object(), _ready({"next_seq": 7})
        return answer()


async def _ready_value(v):
    return v


def _ready(v):
    return _ready_value(v)


class _Handle:
    def __init__(self, log: list, **methods) -> None:
        for name, spec in methods.items():
            setattr(self, name, _Method(log, name, *spec))


class _End:
    def __init__(self, name: str, identity: str | None, handle: _Handle) -> None:
        from types import SimpleNamespace

        self.name, self.handle, self.status = name, handle, SimpleNamespace(identity=identity)


def _refused(method: str):
    from ray.exceptions import RayTaskError

    return RayTaskError(method, "traceback", HandoffUnavailable("cannot map it here"))


def _move(src_identity, dst_identity, *, via="auto", handoff_error=None, import_error=None, source_dies=False):
    """One ``Moves._move`` between fake workers: (its report, the calls made at each end, the counters).
    ``source_dies``: the source is dead when probed after the target's import."""
    import asyncio
    from types import SimpleNamespace

    from cadence_fx.serve.controller import ControllerConfig
    from cadence_fx.serve.metrics import ServeMetrics
    from cadence_fx.serve.migration import Moves

    layout = PackLayout.of({"x": torch.zeros(4)})
    h = DeviceHandoff("c", "node/GPU-1", layout, (), torch.get_rng_state(), None, 7, 1)
    src_log, dst_log = [], []
    src = _End("w0", src_identity, _Handle(src_log, handoff=(h, handoff_error), checkpoint=(), close=()))
    dst = _End("w1", dst_identity, _Handle(dst_log, import_handoff=(16, import_error), import_conversation=(16,),
                                           close=()))
    moves = Moves()
    moves.config, moves.metrics = ControllerConfig(), ServeMetrics()
    conv = SimpleNamespace(conv_id="c", epoch=0, worker="w0", next_seq=7, also_on=None)
    resumed = []

    async def probe(w):
        return not (source_dies and w is src)

    async def resume(c):
        resumed.append(c.conv_id)
        c.worker = "w2"  # resumed elsewhere from its checkpoint

    moves._probe, moves._resume_locked = probe, resume
    if source_dies:
        from cadence_fx.serve.conversation import NoWorkers

        with pytest.raises(NoWorkers, match="the source died while the target read its buffer"):
            asyncio.run(moves._move(conv, src, dst, "w1", via))
        return resumed, src_log, dst_log, moves.metrics.counters
    report = asyncio.run(moves._move(conv, src, dst, "w1", via))
    assert (conv.worker, conv.epoch, conv.next_seq) == ("w1", 1, 7) and not resumed
    return report, src_log, dst_log, moves.metrics.counters


def test_a_move_between_workers_on_one_gpu_takes_the_device_path():
    report, src, dst, counters = _move("node/GPU-1", "node/GPU-1")
    assert report.path == "device" and report.nbytes == 16
    assert src == ["handoff", "close"] and dst == ["import_handoff"]  # no export to the host
    assert counters["handoff_fallback"] == 0


@pytest.mark.parametrize("where", ["source", "target"])
def test_a_handoff_refused_at_either_end_goes_through_the_object_store_and_is_counted(where):
    errors = {"handoff_error": _refused("handoff")} if where == "source" else {"import_error": _refused("import_handoff")}
    report, src, dst, counters = _move("node/GPU-1", "node/GPU-1", **errors)
    assert report.path == "host" and counters["handoff_fallback"] == 1
    assert src == ["handoff", "checkpoint", "close"]
    assert dst == (["import_conversation"] if where == "source" else ["import_handoff", "import_conversation"])


@pytest.mark.parametrize("ids,via", [(("node/GPU-1", "node/GPU-2"), "auto"), (("node/GPU-1", None), "auto"),
                                     ((None, None), "auto"), (("node/GPU-1", "node/GPU-1"), "host")])
def test_workers_on_other_devices_or_a_forced_host_move_never_try_the_device(ids, via):
    report, src, dst, counters = _move(*ids, via=via)
    assert report.path == "host" and src == ["checkpoint", "close"] and dst == ["import_conversation"]
    assert counters["handoff_fallback"] == 0


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3),
                          st.booleans(), st.integers(0, 2**31 - 1)), min_size=0, max_size=6))
def test_any_state_packs_and_crosses_pickle_with_every_bit(regions):
    """Any regions (dtypes, empty and scalar shapes, views with strides) pack, unpack and travel as
    one buffer with their bits, dtypes and shapes."""
    state = {}
    for j, (dtype, shape, strided, seed) in enumerate(regions):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, 256, (2 * max(1, math.prod(shape)) * 16,), generator=g, dtype=torch.uint8)
        raw = base[:math.prod(shape) * dtype.itemsize]
        # a bool a kernel wrote is 0 or 1 (copies normalize any other byte), so the state's are too
        t = (raw % 2).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)
        if strided and t.dim() >= 1 and t.shape[0] > 1:
            t = t[::2]
        state[f"r{j}"] = t
    flat, layout = pack(state)
    cs = ConversationState.of_packed("c", flat, layout, RngStates(torch.get_rng_state(), None), next_seq=0, seed=None)
    buffers: list = []
    back = pickle.loads(pickle.dumps(cs, protocol=5, buffer_callback=buffers.append), buffers=buffers)
    for name, t in state.items():
        got = back.state[name]
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), name
        assert np.array_equal(_bits(got), _bits(t)), name



def test_one_element_taken_with_a_step_digests_encodes_and_compares_like_its_dense_copy():
    """The tensor ``contiguous().view(torch.uint8)`` raises on (size-1 last dim, stride 2): every path
    that reads a tensor's bytes takes it (digests, bit comparison, the front end's frames)."""
    from cadence_fx.determinism import bits_equal
    from cadence_fx.serve.protocol import decode_frame, encode_frame

    odd = torch.tensor([1.5, -2.0])[::2]
    dense = torch.tensor([1.5])
    assert odd.is_contiguous() and odd.stride() == (2,)
    assert sha256_tensors([odd]) == sha256_tensors([dense])
    assert bits_equal(odd, dense)
    frame = decode_frame(encode_frame(1, 0, 0, [odd]))
    assert torch.equal(frame.tensors[0], dense)


def test_a_source_dead_after_the_target_read_its_buffer_is_not_trusted_the_conversation_resumes():
    """The memory of a process that exits is freed under its mappings: a target that copied from a
    source found dead afterwards may hold other bytes, so its copy is closed and the conversation is
    resumed from its checkpoint instead (never a move of unverified bytes)."""
    resumed, src, dst, _counters = _move("node/GPU-1", "node/GPU-1", source_dies=True)
    assert resumed == ["c"] and src == ["handoff"] and dst == ["import_handoff", "close"]


@pytest.mark.cuda
def test_a_reserved_pinned_block_is_what_the_next_export_of_its_size_copies_into():
    from cadence_fx.serve.packing import reserve_pinned

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    n = 3 << 20
    ptr = reserve_pinned(n)
    host = to_host(torch.zeros(n, dtype=torch.uint8, device="cuda"))
    assert host.is_pinned() and host.data_ptr() == ptr  # the cached block: no new page-locking

