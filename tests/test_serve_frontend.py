"""The streaming front end (cadence_fx.serve): the wire format's checks and a fuzz of its decoders, then
a real WebSocket client (``websockets``) against the app served by Ray Serve on a local 2-CPU Ray, over
the demo decoder's sessions on the CPU: every stream is SHA-256-identical to its solo run through the
unmodified exported programs, through interleaving, barge-in, every protocol error, flooding and
disconnects."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
import urllib.request

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cadence_fx as cf
from cadence_fx.serve.protocol import (CHUNK, DEADLINE_MISSED, DTYPE_CODES, HEADER, MAGIC, OUTPUT, ErrorCode, Frame,
                                       ProtocolError, StreamClient, TensorSpec, check_inputs, decode_control,
                                       decode_frame, encode_control, encode_frame)
from cadence_fx.testing.demo_model import DemoConfig
from tests.helpers import demo_catalog, demo_inputs, sha256

CFG = DemoConfig()
MAX_FRAME = 1 << 16  # the served front end's frame limit in these tests
SPECS = [TensorSpec("tokens", torch.float32, (1, CFG.chunk, CFG.dim)), TensorSpec("noise", torch.float32,
                                                                                  (1, CFG.chunk, CFG.dim))]


# ---------------------------------------------------------------------------------------- the wire format
def _frame(tensors=None, **kw) -> bytes:
    tensors = tensors if tensors is not None else [torch.randn(1, 4, 16), torch.randn(1, 4, 16)]
    return encode_frame(kw.pop("kind", CHUNK), kw.pop("conv", 7), kw.pop("seq", 3), tensors, **kw)


def _code(fn, *args, **kw) -> ErrorCode:
    with pytest.raises(ProtocolError) as e:
        fn(*args, **kw)
    return e.value.code


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.flatten().view(torch.uint8).numpy()) == \
        bytes(b.flatten().view(torch.uint8).numpy()) if a.dtype != torch.bool else torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(DTYPE_CODES)), st.lists(st.integers(0, 4), max_size=4)), max_size=5),
       st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_frames_round_trip_every_dtype_and_rank(layout, conv, seq, micros):
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randint(0, 2, s, generator=g) if DTYPE_CODES[c] == torch.bool else
                torch.randint(-100, 100, s, generator=g) if not DTYPE_CODES[c].is_floating_point else
                torch.randn(s, generator=g)).to(DTYPE_CODES[c]) for c, s in layout]
    data = encode_frame(OUTPUT, conv, seq, tensors, flags=DEADLINE_MISSED, micros=micros)
    f = decode_frame(data, max_bytes=len(data))
    assert (f.kind, f.conv, f.seq, f.flags, f.micros, f.nbytes) == (OUTPUT, conv, seq, DEADLINE_MISSED, micros, len(data))
    assert len(f.tensors) == len(tensors) and all(_same_bytes(a, b) for a, b in zip(f.tensors, tensors))
    assert decode_frame(encode_frame(CHUNK, conv, seq, [t.t() if t.dim() == 2 else t for t in tensors])).kind == CHUNK


def _patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


FIRST = HEADER.size  # the first tensor descriptor
BAD_FRAMES = {
    "bad magic": (lambda d: b"XXXX" + d[4:], ErrorCode.BAD_MAGIC),
    "not even a header": (lambda d: b"\x00\x01", ErrorCode.BAD_MAGIC),
    "header cut short": (lambda d: d[:10], ErrorCode.TRUNCATED),
    "version 2": (lambda d: _patch(d, 4, "<B", 2), ErrorCode.BAD_VERSION),
    "an output frame sent as a chunk": (lambda d: _patch(d, 5, "<B", OUTPUT), ErrorCode.BAD_KIND),
    "kind 9": (lambda d: _patch(d, 5, "<B", 9), ErrorCode.BAD_KIND),
    "a flag on a chunk": (lambda d: _patch(d, 6, "<H", DEADLINE_MISSED), ErrorCode.BAD_HEADER),
    "reserved field set": (lambda d: _patch(d, 26, "<H", 1), ErrorCode.BAD_HEADER),
    "17 tensors": (lambda d: _patch(d, 24, "<H", 17), ErrorCode.BAD_HEADER),
    "rank 9": (lambda d: _patch(d, FIRST + 1, "<B", 9), ErrorCode.BAD_HEADER),
    "dtype code 0": (lambda d: _patch(d, FIRST, "<B", 0), ErrorCode.BAD_DTYPE),
    "dtype code 200": (lambda d: _patch(d, FIRST, "<B", 200), ErrorCode.BAD_DTYPE),
    "cut in a descriptor": (lambda d: d[:FIRST + 1], ErrorCode.TRUNCATED),
    "cut in a shape": (lambda d: d[:FIRST + 5], ErrorCode.TRUNCATED),
    "cut in the payload": (lambda d: d[:-1], ErrorCode.TRUNCATED),
    "1 tensor declared, 2 sent": (lambda d: _patch(d, 24, "<H", 1), ErrorCode.TRAILING_BYTES),
    "a byte after the last tensor": (lambda d: d + b"\x00", ErrorCode.TRAILING_BYTES),
    "a shape declaring 4 GiB": (lambda d: _patch(d, FIRST + 2, "<I", 2**30), ErrorCode.FRAME_TOO_LARGE),
    "over the frame limit": (lambda d: d + bytes(MAX_FRAME), ErrorCode.FRAME_TOO_LARGE),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_every_malformed_frame_is_a_protocol_error(case):
    mutate, code = BAD_FRAMES[case]
    assert _code(decode_frame, mutate(_frame()), max_bytes=MAX_FRAME, kinds=(CHUNK,)) == code


def test_bool_bytes_and_tensor_checks():
    bad_bool = bytearray(_frame([torch.tensor([True, False])]))
    bad_bool[-1] = 2
    assert _code(decode_frame, bytes(bad_bool)) == ErrorCode.BAD_VALUE
    ok = decode_frame(_frame())
    check_inputs(ok, SPECS)
    wrong = {
        ErrorCode.WRONG_ARITY: [torch.randn(1, 4, 16)],
        ErrorCode.WRONG_DTYPE: [torch.randn(1, 4, 16, dtype=torch.float64), torch.randn(1, 4, 16)],
        ErrorCode.WRONG_SHAPE: [torch.randn(1, 4, 16), torch.randn(1, 3, 16)],
    }
    for code, tensors in wrong.items():
        err = pytest.raises(ProtocolError, check_inputs, decode_frame(_frame(tensors, conv=5, seq=2)), SPECS).value
        assert (err.code, err.conv, err.seq) == (code, 5, 2)
    with pytest.raises(ValueError):
        encode_frame(CHUNK, -1, 0, [])


BAD_CONTROL = {
    "not JSON": ("{open", ErrorCode.BAD_JSON),
    "a JSON list": ("[1, 2]", ErrorCode.BAD_JSON),
    "nested past the recursion limit": ("[" * 3000, ErrorCode.BAD_JSON),
    "unknown type": ('{"type": "launch"}', ErrorCode.BAD_MESSAGE),
    "no type": ('{"conv": 1}', ErrorCode.BAD_MESSAGE),
    "missing conv": ('{"type": "close"}', ErrorCode.BAD_MESSAGE),
    "unknown field": ('{"type": "close", "conv": 1, "force": true}', ErrorCode.BAD_MESSAGE),
    "conv a string": ('{"type": "close", "conv": "1"}', ErrorCode.BAD_MESSAGE),
    "conv a bool": ('{"type": "close", "conv": true}', ErrorCode.BAD_MESSAGE),
    "conv negative": ('{"type": "close", "conv": -1}', ErrorCode.BAD_MESSAGE),
    "seed a float": ('{"type": "open", "seed": 1.5}', ErrorCode.BAD_MESSAGE),
    "deadline NaN": ('{"type": "open", "deadline_ms": NaN}', ErrorCode.BAD_MESSAGE),
    "token too long": (json.dumps({"type": "restore", "conv": 1, "token": "x" * 300}), ErrorCode.BAD_MESSAGE),
    "over the control limit": (json.dumps({"type": "open", "ref": "x" * 5000}), ErrorCode.FRAME_TOO_LARGE),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTROL))
def test_every_malformed_control_message_is_a_protocol_error(case):
    text, code = BAD_CONTROL[case]
    assert _code(decode_control, text) == code


def test_control_messages_parse():
    assert decode_control(encode_control("open", seed=3, prompt=None, deadline_ms=50.0, ref="a")) == \
        {"type": "open", "seed": 3, "deadline_ms": 50.0, "ref": "a"}
    assert decode_control('{"type": "restore", "conv": 2, "token": "t"}')["token"] == "t"


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decodes_or_refuses(data: bytes) -> None:
    try:
        f = decode_frame(data, max_bytes=MAX_FRAME)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)
    else:
        assert isinstance(f, Frame) and f.nbytes == len(data)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_never_crash_the_decoder(data):
    _decodes_or_refuses(data)
    _decodes_or_refuses(MAGIC + b"\x01\x01" + data)  # past the magic, version and kind


@FUZZ
@given(st.data())
def test_fuzz_mutated_frames_never_crash_the_decoder(data):
    frame = bytearray(_frame([torch.randn(2, 3), torch.tensor([True]), torch.arange(4)]))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del frame[at:at + data.draw(st.integers(1, 8))]
        else:
            frame[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    _decodes_or_refuses(bytes(frame))


@FUZZ
@given(st.one_of(st.text(max_size=300), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(["type", "conv", "seed", "token", "x"]),
                                                              kids, max_size=4), max_leaves=10).map(json.dumps)))
def test_fuzz_control_text_never_crashes_the_decoder(text):
    try:
        msg = decode_control(text)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)
    else:
        assert msg["type"] in ("open", "snapshot", "restore", "close")


# ---------------------------------------------------------------------------------------- served by Ray Serve
@pytest.fixture(scope="module")
def server():
    ray = pytest.importorskip("ray")
    from ray import serve

    from cadence_fx.serve import frontend

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = {"max_frame_bytes": MAX_FRAME, "max_in_flight": 2, "max_conversations": 4, "deadline_ms": 60_000}
        serve.run(frontend.app(kwargs={"dim": CFG.dim, "chunk": CFG.chunk}, config=config), name="frontend-test",
                  route_prefix="/")
        yield f"127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def solo():
    """``solo(prompt, seed, calls)``: the frames of that conversation alone through the unmodified programs."""
    model, _contract, eps = demo_catalog(CFG)
    ref, initial, cache = cf.reference(eps), model.initial_state(), {}

    def run(prompt: int, seed: int, calls: int) -> list[torch.Tensor]:
        state, frames = cache.setdefault((prompt, seed), ([s + prompt * 0.01 for s in initial], []))
        while len(frames) < calls:
            tokens, noise = demo_inputs(CFG, seed, len(frames))
            out = ref(tokens, *state, noise)
            frames.append(out[0].clone())
            state[:] = [t.clone() for t in out[1:]]
        return frames[:calls]

    return run


class Stream:
    """One conversation over a client: chunk k carries ``demo_inputs(seed, k)``; the frames it got."""

    def __init__(self, client: StreamClient, seed: int) -> None:
        self.client, self.seed, self.frames, self.latency = client, seed, [], []

    async def open(self, **kw) -> "Stream":
        self.opened = await self.client.open(seed=self.seed, prompt=self.seed, **kw)
        self.conv = self.opened["conv"]
        return self

    async def step(self, k: int | None = None) -> Frame:
        k = len(self.frames) if k is None else k
        t = time.perf_counter()
        f = await self.client.chunk(self.conv, k, list(demo_inputs(CFG, self.seed, k)))
        self.latency.append(time.perf_counter() - t)
        assert f.seq == k and len(f.tensors) == 1
        del self.frames[k:]
        self.frames.append(f.tensors[0])
        return f

    def exact(self, solo) -> bool:
        return sha256(self.frames) == sha256(solo(self.seed, self.seed, len(self.frames)))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _connect(server):
    import websockets  # noqa: PLC0415

    ws = await websockets.connect(f"ws://{server}/v1/stream", max_size=None)
    return ws, StreamClient(ws)


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{server}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _wait_metric(server, name: str, pred, timeout: float = 20.0) -> float:
    end = time.monotonic() + timeout
    while True:
        v = _metrics(server)[name]
        if pred(v) or time.monotonic() > end:
            return v
        time.sleep(0.1)


def test_two_conversations_interleaved_are_each_their_solo_run(server, solo):
    async def main():
        ws, client = await _connect(server)
        a, b = await Stream(client, 1).open(), await Stream(client, 2).open()
        assert a.opened["inputs"] == [{"name": n, "dtype": "float32", "shape": [1, CFG.chunk, CFG.dim]}
                                      for n in ("tokens", "noise")]
        for k in range(6):  # both chunks in flight at once, on one connection
            fa, fb = await asyncio.gather(a.step(k), b.step(k))
            assert fa.flags == fb.flags == 0 and fa.micros > 0
        ws2, client2 = await _connect(server)
        c = await Stream(client2, 1).open()  # the same conversation again, on another connection
        for k in range(6):
            await c.step(k)
        await ws.close()
        await ws2.close()
        return a, b, c

    a, b, c = _run(main())
    assert a.exact(solo) and b.exact(solo) and c.exact(solo)
    assert sha256(a.frames) != sha256(b.frames)


def test_snapshot_then_restore_gives_the_same_bytes(server, solo):
    async def main():
        ws, client = await _connect(server)
        s = await Stream(client, 3).open()
        start = await client.snapshot(s.conv)  # before any chunk: the prompt's state
        for _ in range(3):
            await s.step()
        turn = await client.snapshot(s.conv)
        assert (start["seq"], turn["seq"]) == (0, 3)
        first = [(await s.step()).tensors[0] for _ in range(3)]
        assert (await client.restore(s.conv, turn["token"]))["seq"] == 3  # barge-in: back to the turn
        again = [(await s.step(k)).tensors[0] for k in (3, 4, 5)]
        await client.restore(s.conv, start["token"])
        whole = [(await s.step(k)).tensors[0] for k in range(6)]
        await ws.close()
        return s, first, again, whole

    s, first, again, whole = _run(main())
    assert sha256(first) == sha256(again) and s.exact(solo) and sha256(whole) == sha256(s.frames)


def test_protocol_errors_cost_the_other_conversation_nothing(server, solo):
    x = list(demo_inputs(CFG, 9, 0))
    good = encode_frame(CHUNK, 0, 0, x)

    async def main():
        ws_v, client_v = await _connect(server)
        victim = await Stream(client_v, 4).open()
        await victim.step()
        ws, client = await _connect(server)
        mine = await Stream(client, 5).open()
        gone = await client.open(seed=1)
        await client.close(gone["conv"])
        conv = mine.conv

        async def chunk(tensors, c=None, seq=0):
            return await client.chunk(conv if c is None else c, seq, tensors)

        async def raw(data: bytes | str):
            await ws.send(data)
            return _raise(await client.expect(lambda m: isinstance(m, dict) and m.get("type") == "error"))

        cases = {
            "wrong dtype": (lambda: chunk([x[0].double(), x[1]]), ErrorCode.WRONG_DTYPE),
            "wrong shape": (lambda: chunk([x[0][:, :2], x[1]]), ErrorCode.WRONG_SHAPE),
            "one tensor": (lambda: chunk(x[:1]), ErrorCode.WRONG_ARITY),
            "an int tensor": (lambda: chunk([x[0].long(), x[1]]), ErrorCode.WRONG_DTYPE),
            "unknown conversation": (lambda: chunk(x, 987_654), ErrorCode.UNKNOWN_CONVERSATION),
            "another connection's conversation": (lambda: chunk(x, victim.conv, 1), ErrorCode.UNKNOWN_CONVERSATION),
            "closed conversation": (lambda: chunk(x, gone["conv"]), ErrorCode.CONVERSATION_CLOSED),
            "snapshot of a closed one": (lambda: client.snapshot(gone["conv"]), ErrorCode.CONVERSATION_CLOSED),
            "a skipped chunk": (lambda: chunk(x, seq=5), ErrorCode.BAD_SEQUENCE),
            "an unknown snapshot": (lambda: client.restore(conv, "nope"), ErrorCode.UNKNOWN_SNAPSHOT),
            "bad magic": (lambda: raw(b"JUNK" + good[4:]), ErrorCode.BAD_MAGIC),
            "truncated": (lambda: raw(good[:-3]), ErrorCode.TRUNCATED),
            "oversized": (lambda: raw(good + bytes(MAX_FRAME)), ErrorCode.FRAME_TOO_LARGE),
            "not JSON": (lambda: raw("{nope"), ErrorCode.BAD_JSON),
            "unknown message": (lambda: raw('{"type": "reboot"}'), ErrorCode.BAD_MESSAGE),
            "a bad prompt": (lambda: client.open(prompt=10**6), ErrorCode.BAD_PROMPT),
            "a zero deadline": (lambda: client.open(deadline_ms=0), ErrorCode.BAD_MESSAGE),
        }
        for name, (act, code) in cases.items():
            with pytest.raises(ProtocolError) as e:
                await act()
            assert e.value.code == code, name
            await victim.step()  # the other conversation goes on, exact
        for _ in range(3):  # and so does the erring client's own conversation: no bad chunk reached it
            await mine.step()
        opened = [await client.open() for _ in range(3)]  # 4 open on this connection: the limit
        with pytest.raises(ProtocolError) as e:
            await client.open()
        assert e.value.code == ErrorCode.TOO_MANY_CONVERSATIONS and len(opened) == 3
        await ws.close()
        await ws_v.close()
        return victim, mine

    victim, mine = _run(main())
    assert victim.exact(solo) and len(victim.frames) == 18 and mine.exact(solo)
    assert _metrics(server)['cadence_frontend_errors_total{code="WRONG_DTYPE"}'] >= 2


def _raise(msg: dict) -> dict:
    raise ProtocolError(ErrorCode(msg["code"]), msg["message"], conv=msg.get("conv"), seq=msg.get("seq"))


def test_a_flooding_client_gets_busy_and_costs_others_nothing(server, solo):
    async def main():
        ws_v, client_v = await _connect(server)
        victim = await Stream(client_v, 6).open()
        await victim.step()  # warm
        ws, client = await _connect(server)
        flood = await Stream(client, 7).open()
        stop = asyncio.Event()

        async def stream_victim():
            while not stop.is_set():
                await victim.step()

        async def flood_it():
            codes = []
            for k in range(4):
                frame = encode_frame(CHUNK, flood.conv, k, list(demo_inputs(CFG, 7, k)))
                for _ in range(25):  # the chunk, then 24 copies before its reply
                    await ws.send(frame)
                # the copies' errors name the same chunk: wait for the frame itself
                got = await client.expect(lambda m: isinstance(m, Frame) and (m.conv, m.seq) == (flood.conv, k))
                flood.frames.append(got.tensors[0])
                for _ in range(24):
                    err = await client.expect(lambda m: isinstance(m, dict) and m.get("type") == "error")
                    codes.append(err["code"])
            stop.set()
            return codes

        codes, _ = await asyncio.gather(flood_it(), stream_victim())
        # the in-flight bound per connection (2 here): a third conversation's chunk while two are stepped
        trio = [await Stream(client, seed).open() for seed in (8, 9, 10)]
        busy = False
        # a round's third chunk meets two in flight unless the first finished before it was read (a
        # demo step is about a millisecond): rounds until one is refused, enough that a busy machine's
        # scheduling does not decide the test
        for _ in range(50):
            seqs = [len(s.frames) for s in trio]
            for s, k in zip(trio, seqs):
                await client.send_chunk(s.conv, k, list(demo_inputs(CFG, s.seed, k)))
            for s, k in zip(trio, seqs):
                try:
                    s.frames.append((await client.result(s.conv, k)).tensors[0])
                except ProtocolError as e:
                    assert e.code == ErrorCode.BUSY and "on this connection" in e.message, e
                    busy = True
            if busy:
                break
        await ws.close()
        await ws_v.close()
        return victim, flood, codes, busy, trio

    victim, flood, codes, busy, trio = _run(main())
    assert set(codes) <= {"BUSY", "BAD_SEQUENCE"} and codes.count("BUSY") >= 1, codes
    assert busy, "no chunk was refused for the connection's in-flight bound"
    assert victim.exact(solo) and len(victim.frames) >= 2
    assert flood.exact(solo) and all(s.exact(solo) for s in trio)
    assert max(victim.latency) < 5.0, victim.latency  # bounded: the flood's frames are refused, not queued


def test_deadline_is_flagged_and_counted(server, solo):
    async def main():
        ws, client = await _connect(server)
        tight = await Stream(client, 10).open(deadline_ms=0.001)
        loose = await Stream(client, 11).open(deadline_ms=60_000)
        flags = [((await tight.step()).flags, (await loose.step()).flags) for _ in range(3)]
        await ws.close()
        return tight, loose, flags

    before = _metrics(server)["cadence_frontend_deadline_missed_total"]
    tight, loose, flags = _run(main())
    assert flags == [(DEADLINE_MISSED, 0)] * 3
    assert _metrics(server)["cadence_frontend_deadline_missed_total"] == before + 3
    assert tight.exact(solo) and loose.exact(solo)  # late is still exact


def test_a_client_that_disconnects_mid_chunk_frees_its_conversations(server):
    assert _wait_metric(server, "cadence_frontend_conversations", lambda v: v == 0) == 0  # earlier tests' gone
    m = _metrics(server)
    start, chunks = m["cadence_frontend_backend_conversations"], m["cadence_frontend_chunks_total"]

    async def main():
        ws, client = await _connect(server)
        convs = [await client.open(seed=s) for s in (12, 13)]
        held = _metrics(server)["cadence_frontend_backend_conversations"]
        for c in convs:
            await client.send_chunk(c["conv"], 0, list(demo_inputs(CFG, 12, 0)))
        ws.transport.abort()  # gone mid-chunk, no close handshake
        return held

    held = _run(main())
    assert held == start + 2
    assert _wait_metric(server, "cadence_frontend_backend_conversations", lambda v: v == start) == start
    m = _metrics(server)
    assert m["cadence_frontend_conversations"] == start and m["cadence_frontend_connections"] == 0
    # a chunk counts once its step ran; the abort can beat the server's read of a chunk (a reset drops
    # what was not read yet), so 0 to 2 of them count, never more
    assert chunks <= m["cadence_frontend_chunks_total"] <= chunks + 2  # a chunk that ran ran to the end
