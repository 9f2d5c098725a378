"""The streaming front end's wire format: JSON control messages and binary tensor frames.

Pure Python and torch (no Ray, no web framework), so a client needs nothing else to speak it.

Control messages are WebSocket text frames holding one JSON object with a ``type``:
``open``, ``snapshot``, ``restore``, ``close`` from the client; ``opened``, ``snapshot``,
``restored``, ``closed``, ``error`` from the server (:data:`CLIENT_MESSAGES` lists each one's fields).

Tensors travel in WebSocket binary frames: a fixed 28-byte little-endian header

    magic "CDFX" | version u8 | kind u8 | flags u16 | conv u64 | seq u32 | micros u32 | count u16 | 0 u16

then, per tensor, ``dtype code u8 | rank u8 | rank x dim u32``, then each tensor's raw
little-endian bytes (C order) one after the other. A ``CHUNK`` frame (client) carries one chunk's
inputs; an ``OUTPUT`` frame (server) carries its outputs, with ``flags`` bit 0 set when the chunk
missed its conversation's deadline and ``micros`` the backend step's time.

Decoding is strict: every length is checked against the frame before a byte is read, the frame
against a size limit before anything is parsed, dtypes against a whitelist, and (with
:func:`check_inputs`) each tensor against what the program expects. Anything else is a
:class:`ProtocolError` with an :class:`ErrorCode`; nothing else ever escapes :func:`decode_frame` or
:func:`decode_control`.

:class:`ConversationBackend` is the seam between the front end and what runs the steps;
:class:`StreamClient` speaks the protocol from the client side.

Why one module: the wire format, its client and the backend seam are one contract, read by people
who write clients in other languages and by the front end; a client needs this file (and torch) only.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from cadence_fx.determinism import byte_view

__all__ = [
    "CLIENT_MESSAGES", "CHUNK", "ConversationBackend", "StreamClient", "DEADLINE_MISSED", "DTYPE_CODES", "ErrorCode", "Frame", "HEADER", "MAGIC",
    "MAX_CONTROL_BYTES", "MAX_FRAME_BYTES", "MAX_RANK", "MAX_TENSORS", "OUTPUT", "ProtocolError", "TensorSpec",
    "VERSION", "check_inputs", "decode_control", "decode_frame", "encode_control", "encode_frame",
    "error_message", "spec_from_json", "spec_to_json",
]

MAGIC = b"CDFX"
VERSION = 1
CHUNK, OUTPUT = 1, 2  # frame kinds: a chunk's inputs (client -> server), its outputs (server -> client)
KINDS = (CHUNK, OUTPUT)
DEADLINE_MISSED = 1  # flags bit 0 of an OUTPUT frame
HEADER = struct.Struct("<4sBBHQIIHH")  # magic, version, kind, flags, conv, seq, micros, count, reserved
MAX_FRAME_BYTES = 1 << 20  # default limit on one binary frame
MAX_CONTROL_BYTES = 4096  # limit on one JSON control message
MAX_TENSORS = 16
MAX_RANK = 8
U32, U64 = (1 << 32) - 1, (1 << 64) - 1

# The whitelist: wire code -> dtype. Codes are part of the protocol (never renumber; append).
DTYPE_CODES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.float64,
    5: torch.int64, 6: torch.int32, 7: torch.int16, 8: torch.int8, 9: torch.uint8, 10: torch.bool,
}
CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
DTYPE_NAMES = {str(dt).removeprefix("torch."): dt for dt in DTYPE_CODES.values()}


class ErrorCode(str, enum.Enum):
    """Every error the front end reports (the ``code`` of an ``error`` message)."""

    # the frame or message itself
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"  # over the binary or control size limit
    BAD_MAGIC = "BAD_MAGIC"
    BAD_VERSION = "BAD_VERSION"
    BAD_KIND = "BAD_KIND"  # a frame kind the receiver does not take
    BAD_HEADER = "BAD_HEADER"  # unknown flag bits, non-zero reserved field, too many tensors, bad rank
    TRUNCATED = "TRUNCATED"  # the frame ends before what its header declares
    TRAILING_BYTES = "TRAILING_BYTES"  # bytes after the last declared tensor
    BAD_DTYPE = "BAD_DTYPE"  # a dtype code not on the whitelist
    BAD_VALUE = "BAD_VALUE"  # a bool tensor with a byte other than 0 or 1
    BAD_JSON = "BAD_JSON"  # a text frame that is not one JSON object
    BAD_MESSAGE = "BAD_MESSAGE"  # unknown message type, a missing or mistyped field
    # the frame against the conversation
    WRONG_ARITY = "WRONG_ARITY"  # not as many tensors as the program takes per chunk
    WRONG_DTYPE = "WRONG_DTYPE"
    WRONG_SHAPE = "WRONG_SHAPE"
    UNKNOWN_CONVERSATION = "UNKNOWN_CONVERSATION"  # never opened on this connection
    CONVERSATION_CLOSED = "CONVERSATION_CLOSED"
    BAD_SEQUENCE = "BAD_SEQUENCE"  # not the next chunk of the conversation
    UNKNOWN_SNAPSHOT = "UNKNOWN_SNAPSHOT"  # a restore token the conversation does not hold
    BAD_PROMPT = "BAD_PROMPT"
    # load
    BUSY = "BUSY"  # the conversation's previous chunk (or the connection's in-flight limit) is not done
    TOO_MANY_CONVERSATIONS = "TOO_MANY_CONVERSATIONS"
    # the server
    BACKEND_ERROR = "BACKEND_ERROR"  # the step raised; the conversation is as before the chunk
    INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A protocol violation: ``code`` (an :class:`ErrorCode`), a message, and where known the
    conversation and sequence number it concerns."""

    def __init__(self, code: ErrorCode, message: str, *, conv: int | None = None, seq: int | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        self.conv = conv
        self.seq = seq


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the program takes or gives per chunk: its name, dtype and exact shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls(name, t.dtype, tuple(t.shape))


@dataclass(frozen=True)
class Frame:
    """A decoded binary frame."""

    kind: int
    conv: int
    seq: int
    tensors: tuple[torch.Tensor, ...]
    flags: int = 0
    micros: int = 0
    nbytes: int = field(default=0, compare=False)


# ---------------------------------------------------------------------------------------- frames
def _wire_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu")
    raw = byte_view(t) if t.dtype != torch.bool else t.reshape(-1).to(torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(-1)
    return raw.numpy().tobytes() if raw.numel() else b""


def encode_frame(kind: int, conv: int, seq: int, tensors: Sequence[torch.Tensor], *, flags: int = 0,
                 micros: int = 0) -> bytes:
    """One binary frame carrying ``tensors`` (any device; sent as contiguous little-endian bytes)."""
    if kind not in KINDS or not 0 <= conv <= U64 or not 0 <= seq <= U32 or not 0 <= flags <= 0xFFFF:
        raise ValueError(f"encode_frame: kind {kind}, conv {conv}, seq {seq}, flags {flags} out of range")
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"encode_frame: {len(tensors)} tensors (at most {MAX_TENSORS})")
    parts = [HEADER.pack(MAGIC, VERSION, kind, flags, conv, seq, min(max(int(micros), 0), U32), len(tensors), 0)]
    for t in tensors:
        if t.dtype not in CODE_OF or t.dim() > MAX_RANK:
            raise ValueError(f"encode_frame: dtype {t.dtype} / rank {t.dim()} not sendable")
        parts.append(struct.pack(f"<BB{t.dim()}I", CODE_OF[t.dtype], t.dim(), *t.shape))
    parts.extend(_wire_bytes(t) for t in tensors)
    return b"".join(parts)


def decode_frame(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_FRAME_BYTES,
                 kinds: Sequence[int] = KINDS) -> Frame:
    """Parse one binary frame; raises :class:`ProtocolError` on anything but a well-formed frame of
    one of ``kinds`` of at most ``max_bytes`` bytes. The tensors are fresh CPU tensors."""
    n = len(data)
    if n > max_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame of {n} bytes (limit {max_bytes})")
    if n < HEADER.size:
        code = ErrorCode.BAD_MAGIC if bytes(data[:min(n, 4)]) != MAGIC[:min(n, 4)] else ErrorCode.TRUNCATED
        raise ProtocolError(code, f"frame of {n} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, kind, flags, conv, seq, micros, count, reserved = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"version {version}, this server speaks {VERSION}", conv=conv, seq=seq)
    if kind not in kinds:
        raise ProtocolError(ErrorCode.BAD_KIND, f"frame kind {kind} (expected one of {list(kinds)})", conv=conv, seq=seq)
    allowed = DEADLINE_MISSED if kind == OUTPUT else 0
    if flags & ~allowed or reserved or count > MAX_TENSORS:
        raise ProtocolError(ErrorCode.BAD_HEADER, f"flags {flags:#x}, reserved {reserved}, {count} tensors "
                            f"(at most {MAX_TENSORS})", conv=conv, seq=seq)
    pos, shapes = HEADER.size, []
    for i in range(count):
        if pos + 2 > n:
            raise ProtocolError(ErrorCode.TRUNCATED, f"frame ends inside tensor {i}'s descriptor", conv=conv, seq=seq)
        dtype_code, rank = data[pos], data[pos + 1]
        if dtype_code not in DTYPE_CODES:
            raise ProtocolError(ErrorCode.BAD_DTYPE, f"tensor {i}: dtype code {dtype_code} is not one of "
                                f"{sorted(DTYPE_CODES)}", conv=conv, seq=seq)
        if rank > MAX_RANK:
            raise ProtocolError(ErrorCode.BAD_HEADER, f"tensor {i}: rank {rank} (at most {MAX_RANK})", conv=conv, seq=seq)
        if pos + 2 + 4 * rank > n:
            raise ProtocolError(ErrorCode.TRUNCATED, f"frame ends inside tensor {i}'s shape", conv=conv, seq=seq)
        shape = struct.unpack_from(f"<{rank}I", data, pos + 2)
        shapes.append((DTYPE_CODES[dtype_code], shape))
        pos += 2 + 4 * rank
    need = pos + sum(math.prod(s) * dt.itemsize for dt, s in shapes)  # bigints: no overflow
    if need > max_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"declared tensors need {need} bytes (limit {max_bytes})",
                            conv=conv, seq=seq)
    if need > n:
        raise ProtocolError(ErrorCode.TRUNCATED, f"frame of {n} bytes, its header declares {need}", conv=conv, seq=seq)
    if need < n:
        raise ProtocolError(ErrorCode.TRAILING_BYTES, f"{n - need} bytes after the last tensor", conv=conv, seq=seq)
    tensors = []
    for i, (dt, shape) in enumerate(shapes):
        size = math.prod(shape) * dt.itemsize
        tensors.append(_tensor(bytes(data[pos:pos + size]), dt, shape, i, conv, seq))
        pos += size
    return Frame(kind, conv, seq, tuple(tensors), flags, micros, n)


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...], i: int, conv: int, seq: int) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if sys.byteorder != "little" and dtype.itemsize > 1:
        u8 = u8.reshape(-1, dtype.itemsize).flip(-1).contiguous().reshape(-1)
    if dtype == torch.bool:
        if bool((u8 > 1).any()):
            raise ProtocolError(ErrorCode.BAD_VALUE, f"tensor {i}: a bool byte other than 0 or 1", conv=conv, seq=seq)
        return u8.to(torch.bool).reshape(shape)
    return u8.view(dtype).reshape(shape)


def check_inputs(frame: Frame, specs: Sequence[TensorSpec]) -> None:
    """The frame's tensors are exactly what the program takes per chunk (count, dtypes, shapes)."""
    got = frame.tensors
    if len(got) != len(specs):
        raise ProtocolError(ErrorCode.WRONG_ARITY, f"{len(got)} tensors, the program takes {len(specs)} per chunk "
                            f"({[s.name for s in specs]})", conv=frame.conv, seq=frame.seq)
    for t, s in zip(got, specs):
        if t.dtype != s.dtype:
            raise ProtocolError(ErrorCode.WRONG_DTYPE, f"{s.name!r} is {t.dtype}, the program takes {s.dtype}",
                                conv=frame.conv, seq=frame.seq)
        if tuple(t.shape) != tuple(s.shape):
            raise ProtocolError(ErrorCode.WRONG_SHAPE, f"{s.name!r} has shape {list(t.shape)}, the program takes "
                                f"{list(s.shape)}", conv=frame.conv, seq=frame.seq)


# ---------------------------------------------------------------------------------------- control
# Each client message's fields: name -> (accepted types, required).
_INT, _NUM, _STR = (int,), (int, float), (str,)
_REF = ((str, int), False)  # echoed back in the reply: lets a client match replies to requests
CLIENT_MESSAGES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "open": {"seed": (_INT, False), "prompt": (_INT, False), "deadline_ms": (_NUM, False), "ref": _REF},
    "snapshot": {"conv": (_INT, True), "ref": _REF},
    "restore": {"conv": (_INT, True), "token": (_STR, True), "ref": _REF},
    "close": {"conv": (_INT, True), "ref": _REF},
}
SERVER_MESSAGES = ("opened", "snapshot", "restored", "closed", "error")


def decode_control(text: str | bytes, *, max_bytes: int = MAX_CONTROL_BYTES,
                   messages: Mapping[str, Mapping[str, tuple[tuple[type, ...], bool]]] = CLIENT_MESSAGES) -> dict:
    """Parse and check one control message (a client's, by default); raises :class:`ProtocolError`."""
    if len(text) > max_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"control message of {len(text)} characters (limit {max_bytes})")
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"a JSON {type(msg).__name__}, not an object")
    kind = msg.get("type")
    fields = messages.get(kind) if isinstance(kind, str) else None
    conv = msg.get("conv") if type(msg.get("conv")) is int else None
    if fields is None:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"message type {kind!r} (expected one of {sorted(messages)})", conv=conv)
    extra = sorted(set(msg) - set(fields) - {"type"})
    if extra:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{kind!r}: unknown field(s) {extra}", conv=conv)
    for name, (types, required) in fields.items():
        if name not in msg:
            if required:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{kind!r}: missing field {name!r}", conv=conv)
            continue
        v = msg[name]
        ok = (isinstance(v, types) and not isinstance(v, bool)) or (v is None and not required)
        if ok and isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= U64:
            ok = False
        if ok and isinstance(v, float) and not (math.isfinite(v) and v > 0):
            ok = False
        if ok and isinstance(v, str) and len(v) > 256:
            ok = False
        if not ok:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{kind!r}: field {name!r} = {v!r:.80} is not a valid "
                                f"{'/'.join(t.__name__ for t in types)}", conv=conv)
    return msg


def encode_control(kind: str, **fields: Any) -> str:
    """One control message as JSON text (fields that are None are left out)."""
    return json.dumps({"type": kind, **{k: v for k, v in fields.items() if v is not None}}, separators=(",", ":"))


def error_message(err: ProtocolError, *, ref: Any = None) -> str:
    """The ``error`` control message for ``err``."""
    return encode_control("error", code=err.code.value, message=err.message, conv=err.conv, seq=err.seq, ref=ref)


def spec_to_json(specs: Sequence[TensorSpec]) -> list[dict]:
    return [{"name": s.name, "dtype": str(s.dtype).removeprefix("torch."), "shape": list(s.shape)} for s in specs]


def spec_from_json(items: Sequence[Mapping[str, Any]]) -> list[TensorSpec]:
    return [TensorSpec(str(d["name"]), DTYPE_NAMES[d["dtype"]], tuple(int(x) for x in d["shape"])) for d in items]


# ---------------------------------------------------------------------------------------- the seam
@runtime_checkable
class ConversationBackend(Protocol):
    """What the front end (:mod:`cadence_fx.serve.frontend`) needs from whatever runs the steps: an
    in-process program's sessions (:class:`cadence_fx.serve.local_backend.LocalBackend`) or a router
    over Ray workers. Methods may be plain (the front end runs them on its thread pool) or ``async``.

    Errors: raise :class:`ProtocolError` with the code the client should see (``UNKNOWN_CONVERSATION``,
    ``BAD_SEQUENCE``, ``UNKNOWN_SNAPSHOT``, ``BAD_PROMPT``, ``TOO_MANY_CONVERSATIONS``);
    :class:`cadence_fx.SessionClosed` reads as ``CONVERSATION_CLOSED``; anything else is reported as
    ``BACKEND_ERROR`` and must leave the conversation as it was before the call. An optional
    ``open_count() -> int`` (conversations open in the backend) is exported as a metric.
    """

    def open(self, conv_id: str, seed: int | None, prompt: int | None = None) -> Mapping[str, Any]:
        """Start a conversation (random streams from ``seed``, initial state from ``prompt``). Returns
        ``{"inputs": spec_to_json(...)}``, what each chunk carries, plus any fields to show the client
        (``outputs``, ...). A backend without prompts may take ``(conv_id, seed)`` only: the front end
        passes ``prompt`` only when the client sent one."""

    def step(self, conv_id: str, seq: int, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Chunk ``seq`` (0, 1, ...; after a restore, the snapshot's) of the conversation: its outputs."""

    def snapshot(self, conv_id: str) -> str:
        """A token for the conversation's state now (a turn boundary)."""

    def restore(self, conv_id: str, token: str) -> Any:
        """Put the conversation back to the snapshot ``token`` (barge-in)."""

    def close(self, conv_id: str) -> None:
        """End the conversation and free what it holds (closing a closed one is a no-op)."""


# ---------------------------------------------------------------------------------------- a client
class StreamClient:
    """The protocol's client side over one WebSocket connection: anything with ``async send(str |
    bytes)`` and ``async recv() -> str | bytes`` (a ``websockets`` connection). Replies are matched to
    requests (control replies by ``ref``, outputs and chunk errors by conversation and sequence number);
    what arrives for another request waits in :attr:`pending` until asked for. An ``error`` reply is
    raised as :class:`ProtocolError`."""

    def __init__(self, ws: Any, *, max_bytes: int = 64 << 20) -> None:
        self.ws = ws
        self.max_bytes = max_bytes
        self.pending: list[Frame | dict] = []
        self._refs = itertools.count(1)
        self._reading = asyncio.Lock()

    async def request(self, kind: str, **fields: Any) -> dict:
        """Send one control message; its reply (an ``error`` reply raises)."""
        ref = next(self._refs)
        await self.ws.send(encode_control(kind, ref=ref, **fields))
        msg = await self.expect(lambda m: isinstance(m, dict) and m.get("ref") == ref)
        if msg["type"] == "error":
            raise _error_of(msg)
        return msg

    async def open(self, *, seed: int | None = None, prompt: int | None = None,
                   deadline_ms: float | None = None) -> dict:
        """A new conversation: the ``opened`` reply (``conv``, ``inputs``, ``deadline_ms``, ...)."""
        return await self.request("open", seed=seed, prompt=prompt, deadline_ms=deadline_ms)

    async def snapshot(self, conv: int) -> dict:
        return await self.request("snapshot", conv=conv)

    async def restore(self, conv: int, token: str) -> dict:
        return await self.request("restore", conv=conv, token=token)

    async def close(self, conv: int) -> dict:
        return await self.request("close", conv=conv)

    async def send_chunk(self, conv: int, seq: int, tensors: Sequence[torch.Tensor]) -> None:
        await self.ws.send(encode_frame(CHUNK, conv, seq, tensors))

    async def result(self, conv: int, seq: int) -> Frame:
        """The reply to chunk ``seq`` of ``conv``: its ``OUTPUT`` frame (an error reply raises)."""
        def mine(m: Frame | dict) -> bool:
            if isinstance(m, Frame):
                return (m.conv, m.seq) == (conv, seq)
            return m.get("type") == "error" and (m.get("conv"), m.get("seq")) == (conv, seq)
        msg = await self.expect(mine)
        if isinstance(msg, Frame):
            return msg
        raise _error_of(msg)

    async def chunk(self, conv: int, seq: int, tensors: Sequence[torch.Tensor]) -> Frame:
        await self.send_chunk(conv, seq, tensors)
        return await self.result(conv, seq)

    async def expect(self, match: Callable[[Frame | dict], bool]) -> Any:
        """The first message (waiting or arriving) that ``match`` accepts. Coroutines may wait at once
        (one reads the connection at a time; each takes what is its own)."""
        while True:
            for i, m in enumerate(self.pending):
                if match(m):
                    return self.pending.pop(i)
            async with self._reading:
                if any(match(m) for m in self.pending):  # another reader got it meanwhile
                    continue
                raw = await self.ws.recv()
            m = (decode_frame(raw, max_bytes=self.max_bytes, kinds=(OUTPUT,)) if isinstance(raw, (bytes, bytearray))
                 else _decode_reply(raw))
            if match(m):
                return m
            self.pending.append(m)


def _decode_reply(text: str) -> dict:
    try:
        msg = json.loads(text)
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_JSON, f"server sent non-JSON text: {e}") from None
    if not isinstance(msg, dict) or msg.get("type") not in SERVER_MESSAGES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"server sent {text!r:.80}")
    return msg


def _error_of(msg: dict) -> ProtocolError:
    """The :class:`ProtocolError` an ``error`` message reports."""
    return ProtocolError(ErrorCode(msg["code"]), msg.get("message", ""), conv=msg.get("conv"), seq=msg.get("seq"))
