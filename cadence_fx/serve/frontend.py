"""The streaming front end: a WebSocket endpoint (``/v1/stream``) on Ray Serve and FastAPI, and ``/metrics``.

:class:`StreamFrontend` speaks :mod:`cadence_fx.serve.protocol` on each connection and drives a
:class:`~cadence_fx.serve.protocol.ConversationBackend` (:class:`~cadence_fx.serve.local_backend.LocalBackend`
in process, or a router over Ray workers with the same five methods). :class:`StreamDeployment` is
the Serve deployment around it; :func:`app` binds one, :func:`build_app` is the ``serve run`` builder.

Isolation: every check a chunk can fail (its frame, its conversation, its sequence number, its
tensors against what the program takes) runs before the backend sees it, so a bad chunk changes
no state. Backpressure: one chunk in flight per conversation and at most ``max_in_flight`` per
connection; a chunk past either is answered ``BUSY`` at once and dropped, so nothing buffers
without bound and a flooding client costs others only the decoding of its frames. Deadlines: a
chunk answered later than its conversation's deadline (from the frame's arrival) is flagged in
its reply and counted. A connection that goes away (mid-chunk too) has its conversations closed
in the backend once their chunks finish.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``WebSocket``) at run time
import asyncio
import functools
import importlib
import inspect
import itertools
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import prometheus_client as prom
from fastapi import FastAPI, WebSocket
from fastapi.responses import Response
from ray import serve

from cadence_fx.runtime.sessions import SessionClosed
from cadence_fx.serve.protocol import (CHUNK, DEADLINE_MISSED, MAX_CONTROL_BYTES, MAX_FRAME_BYTES, OUTPUT, VERSION,
                                       ConversationBackend, ErrorCode, Frame, ProtocolError, TensorSpec,
                                       check_inputs, decode_control, decode_frame, encode_control, encode_frame,
                                       error_message, spec_from_json, spec_to_json)

__all__ = ["ConversationBackend", "FrontendConfig", "StreamDeployment", "StreamFrontend", "app", "build_app"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    """The front end's limits (each one documented in docs/serving.md, "Front end")."""

    deadline_ms: float = 250.0  # a conversation's deadline per chunk unless its open asks for another
    max_deadline_ms: float = 60_000.0
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_control_bytes: int = MAX_CONTROL_BYTES
    max_conversations: int = 8  # open per connection
    max_in_flight: int = 4  # chunks being stepped per connection, over all its conversations
    max_tokens: int = 64  # snapshot tokens remembered per conversation (oldest dropped)
    step_threads: int = 4  # the pool that runs a plain (not async) backend's methods


@dataclass
class _Conversation:
    wire: int  # its id on the wire
    key: str  # its id in the backend
    inputs: list[TensorSpec]
    deadline_s: float
    seq: int = 0  # the next chunk's sequence number
    task: asyncio.Task | None = None  # the chunk in flight
    tokens: dict[str, int] = field(default_factory=dict)  # snapshot token -> the seq it was taken at


@dataclass
class _Connection:
    ws: WebSocket
    convs: dict[int, _Conversation] = field(default_factory=dict)
    closed: deque = field(default_factory=lambda: deque(maxlen=1024))  # wire ids closed here (recent)
    in_flight: int = 0
    gone: bool = False
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class _Metrics:
    def __init__(self, registry: prom.CollectorRegistry) -> None:
        p = "cadence_frontend_"
        self.connections = prom.Gauge(p + "connections", "WebSocket connections open", registry=registry)
        self.conversations = prom.Gauge(p + "conversations", "conversations open in this front end", registry=registry)
        self.backend_open = prom.Gauge(p + "backend_conversations", "conversations open in the backend "
                                       "(its open_count(); -1 if it has none)", registry=registry)
        self.opened = prom.Counter(p + "opened", "conversations opened", registry=registry)
        self.closed = prom.Counter(p + "closed", "conversations closed (by the client or its disconnect)",
                                   registry=registry)
        self.chunks = prom.Counter(p + "chunks", "chunks answered with outputs", registry=registry)
        self.deadline_missed = prom.Counter(p + "deadline_missed", "chunks answered after their deadline",
                                            registry=registry)
        self.errors = prom.Counter(p + "errors", "error replies, by code", ["code"], registry=registry)
        buckets = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
        self.chunk_seconds = prom.Histogram(p + "chunk_seconds", "a chunk's frame arrival to its reply",
                                            buckets=buckets, registry=registry)
        self.step_seconds = prom.Histogram(p + "step_seconds", "the backend's step of a chunk", buckets=buckets,
                                           registry=registry)


class StreamFrontend:
    """The protocol on WebSocket connections (:meth:`serve`), over one backend."""

    def __init__(self, backend: ConversationBackend, config: FrontendConfig | None = None) -> None:
        self.backend = backend
        self.config = config or FrontendConfig()
        self.registry = prom.CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self._pool = ThreadPoolExecutor(self.config.step_threads, thread_name_prefix="cadence-frontend")
        self._ids = itertools.count(1)
        self._tag = uuid.uuid4().hex[:8]  # backend ids are unique across front-end replicas
        self._cleanups: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ one connection
    async def serve(self, ws: WebSocket) -> None:
        """Run one connection until the client goes away; then close its conversations."""
        await ws.accept()
        conn = _Connection(ws)
        self.metrics.connections.inc()
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                arrived = time.perf_counter()
                ref = None
                try:
                    if msg.get("bytes") is not None:
                        await self._on_chunk(conn, msg["bytes"], arrived)
                    elif msg.get("text") is not None:
                        control = decode_control(msg["text"], max_bytes=self.config.max_control_bytes)
                        ref = control.get("ref")
                        await self._on_control(conn, control)
                except ProtocolError as e:
                    await self._error(conn, e, ref=ref)
                except Exception as e:  # a bug of ours: this message fails, the connection goes on
                    log.exception("front end: handling a message")
                    await self._error(conn, ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[:500]), ref=ref)
        finally:
            conn.gone = True
            convs = list(conn.convs.values())
            conn.convs.clear()
            self.metrics.connections.dec()
            await asyncio.shield(asyncio.gather(*(self._ending(conv) for conv in convs)))

    def _ending(self, conv: _Conversation) -> asyncio.Task:
        """:meth:`_end` as a task of its own: it runs to the end even if the handler that started it
        is cancelled (the proxy saw the client go)."""
        task = asyncio.ensure_future(self._end(conv))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _end(self, conv: _Conversation) -> None:
        """Close ``conv`` in the backend after its chunk in flight (if any) is done."""
        if conv.task is not None:
            await asyncio.wait([conv.task])
        try:
            await self._call(self.backend.close, conv.key)
        except Exception:  # the client is told nothing more: log it, count the conversation closed
            log.exception("closing conversation %s", conv.key)
        self.metrics.conversations.dec()
        self.metrics.closed.inc()

    # ------------------------------------------------------------------ chunks
    async def _on_chunk(self, conn: _Connection, data: bytes, arrived: float) -> None:
        frame = decode_frame(data, max_bytes=self.config.max_frame_bytes, kinds=(CHUNK,))
        conv = self._lookup(conn, frame.conv, frame.seq)
        if conv.task is not None:
            raise ProtocolError(ErrorCode.BUSY, f"chunk {conv.seq - 1} of this conversation is still running: "
                                "send the next after its reply", conv=frame.conv, seq=frame.seq)
        if conn.in_flight >= self.config.max_in_flight:
            raise ProtocolError(ErrorCode.BUSY, f"{conn.in_flight} chunks in flight on this connection (at most "
                                f"{self.config.max_in_flight})", conv=frame.conv, seq=frame.seq)
        if frame.seq != conv.seq:
            raise ProtocolError(ErrorCode.BAD_SEQUENCE, f"chunk {frame.seq}, expected {conv.seq}",
                                conv=frame.conv, seq=frame.seq)
        check_inputs(frame, conv.inputs)
        conv.seq += 1
        conn.in_flight += 1
        conv.task = asyncio.ensure_future(self._step(conn, conv, frame, arrived))

    async def _step(self, conn: _Connection, conv: _Conversation, frame: Frame, arrived: float) -> None:
        reply: bytes | None = None
        try:
            args = (conv.key, frame.seq, list(frame.tensors))
            if inspect.iscoroutinefunction(self.backend.step):
                started = time.perf_counter()
                outs, step_s = await self.backend.step(*args), time.perf_counter() - started
            else:  # timed in the pool thread: the hand-off is the front end's time, not the step's
                outs, step_s = await self._call(_timed, self.backend.step, *args)
            missed = time.perf_counter() - arrived > conv.deadline_s
            reply = encode_frame(OUTPUT, conv.wire, frame.seq, list(outs), flags=DEADLINE_MISSED if missed else 0,
                                 micros=round(step_s * 1e6))
            self.metrics.step_seconds.observe(step_s)
            self.metrics.chunks.inc()
            if missed:
                self.metrics.deadline_missed.inc()
        except Exception as e:  # the backend refused or raised: the conversation is as before the chunk
            conv.seq = frame.seq
            error = _as_protocol_error(e, conv.wire, frame.seq)
        finally:  # done before the reply goes: the client may send the next chunk the moment it has it
            conv.task = None
            conn.in_flight -= 1
        if reply is None:
            await self._error(conn, error)
            return
        await self._send(conn, reply)
        self.metrics.chunk_seconds.observe(time.perf_counter() - arrived)

    # ------------------------------------------------------------------ control messages
    async def _on_control(self, conn: _Connection, msg: dict) -> None:
        kind, ref = msg["type"], msg.get("ref")
        if kind == "open":
            await self._open(conn, msg, ref)
            return
        conv = self._lookup(conn, msg["conv"], None)
        if kind == "close":
            del conn.convs[conv.wire]
            conn.closed.append(conv.wire)
            await asyncio.shield(self._ending(conv))
            await self._send(conn, encode_control("closed", conv=conv.wire, ref=ref))
            return
        if conv.task is not None:
            raise ProtocolError(ErrorCode.BUSY, f"{kind}: chunk {conv.seq - 1} is still running", conv=conv.wire)
        try:
            if kind == "snapshot":
                token = await self._call(self.backend.snapshot, conv.key)
                conv.tokens[token] = conv.seq
                while len(conv.tokens) > self.config.max_tokens:
                    del conv.tokens[next(iter(conv.tokens))]
                reply = encode_control("snapshot", conv=conv.wire, token=token, seq=conv.seq, ref=ref)
            else:  # restore
                token = msg["token"]
                if token not in conv.tokens:
                    raise ProtocolError(ErrorCode.UNKNOWN_SNAPSHOT, f"no snapshot {token!r:.40} of this conversation")
                await self._call(self.backend.restore, conv.key, token)
                conv.seq = conv.tokens[token]
                reply = encode_control("restored", conv=conv.wire, seq=conv.seq, ref=ref)
        except Exception as e:
            raise _as_protocol_error(e, conv.wire, None) from None
        await self._send(conn, reply)

    async def _open(self, conn: _Connection, msg: dict, ref: Any) -> None:
        cfg = self.config
        if len(conn.convs) >= cfg.max_conversations:
            raise ProtocolError(ErrorCode.TOO_MANY_CONVERSATIONS, f"{len(conn.convs)} conversations open on this "
                                f"connection (at most {cfg.max_conversations})")
        deadline_ms = msg.get("deadline_ms")
        deadline_ms = cfg.deadline_ms if deadline_ms is None else deadline_ms
        if not 0 < deadline_ms <= cfg.max_deadline_ms:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"deadline_ms {deadline_ms} (0 < deadline_ms <= "
                                f"{cfg.max_deadline_ms})")
        wire = next(self._ids)
        conv = _Conversation(wire, f"{self._tag}-{wire}", [], deadline_ms / 1e3)
        prompt = {} if msg.get("prompt") is None else {"prompt": msg["prompt"]}
        # the open is the conversation's task in flight: a disconnect meanwhile closes it once it is open
        opening = conv.task = asyncio.ensure_future(self._call(self.backend.open, conv.key, msg.get("seed"), **prompt))
        conn.convs[wire] = conv
        self.metrics.conversations.inc()
        try:
            info = dict(await asyncio.shield(opening))
            conv.inputs = spec_from_json(info.pop("inputs"))
        except Exception as e:
            del conn.convs[wire]
            self.metrics.conversations.dec()
            if opening.exception() is None:  # open, but what it said is unusable
                await self._call(self.backend.close, conv.key)
            raise _as_protocol_error(e, None, None) from None
        conv.task = None
        self.metrics.opened.inc()
        fields = {**info, "conv": wire, "version": VERSION, "inputs": spec_to_json(conv.inputs),
                  "deadline_ms": deadline_ms, "max_frame_bytes": cfg.max_frame_bytes, "ref": ref}
        await self._send(conn, encode_control("opened", **fields))

    # ------------------------------------------------------------------ plumbing
    def _lookup(self, conn: _Connection, wire: int, seq: int | None) -> _Conversation:
        conv = conn.convs.get(wire)
        if conv is None:
            if wire in conn.closed:
                raise ProtocolError(ErrorCode.CONVERSATION_CLOSED, f"conversation {wire} was closed", conv=wire, seq=seq)
            raise ProtocolError(ErrorCode.UNKNOWN_CONVERSATION, f"no conversation {wire} on this connection",
                                conv=wire, seq=seq)
        return conv

    async def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """A backend method: awaited if async, else on the thread pool (never on the event loop)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        out = await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        return await out if inspect.isawaitable(out) else out

    async def _send(self, conn: _Connection, data: str | bytes) -> None:
        if conn.gone:
            return
        try:
            async with conn.send_lock:
                if isinstance(data, bytes):
                    await conn.ws.send_bytes(data)
                else:
                    await conn.ws.send_text(data)
        except Exception:  # the client went away: its conversations are closed when serve() returns
            conn.gone = True

    async def _error(self, conn: _Connection, err: ProtocolError, *, ref: Any = None) -> None:
        self.metrics.errors.labels(err.code.value).inc()
        await self._send(conn, error_message(err, ref=ref))

    async def metrics_text(self) -> bytes:
        """The Prometheus exposition of this front end's metrics."""
        count = getattr(self.backend, "open_count", None)
        if count is not None:
            n = await self._call(count)
            self.metrics.backend_open.set(n)
        else:
            self.metrics.backend_open.set(-1)
        return prom.generate_latest(self.registry)


def _timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - started


def _as_protocol_error(e: Exception, conv: int | None, seq: int | None) -> ProtocolError:
    if isinstance(e, ProtocolError):
        return ProtocolError(e.code, e.message, conv=conv if conv is not None else e.conv, seq=seq)
    if isinstance(e, SessionClosed):
        return ProtocolError(ErrorCode.CONVERSATION_CLOSED, str(e), conv=conv, seq=seq)
    log.warning("backend error on conversation %s chunk %s: %r", conv, seq, e)
    return ProtocolError(ErrorCode.BACKEND_ERROR, f"{type(e).__name__}: {e}"[:500], conv=conv, seq=seq)


# ---------------------------------------------------------------------------------------- Ray Serve
fastapi_app = FastAPI(title="cadence_fx streaming front end")


def resolve_backend(factory: str | Callable[..., Any], kwargs: Mapping[str, Any] | None = None) -> Any:
    """The backend ``factory(**kwargs)`` builds (``factory`` a callable or ``"module:attr"``)."""
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        return getattr(importlib.import_module(module), attr)(**dict(kwargs or {}))
    return factory(**dict(kwargs or {}))


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 1})
@serve.ingress(fastapi_app)
class StreamDeployment:
    """The Serve deployment: builds its backend in the replica (``factory(**kwargs)``), serves
    ``/v1/stream`` (the protocol) and ``/metrics`` (Prometheus text). Each WebSocket connection is
    one ongoing request for its whole life: ``max_ongoing_requests`` bounds connections per replica."""

    def __init__(self, factory: str | Callable[..., Any], kwargs: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        self.frontend = StreamFrontend(resolve_backend(factory, kwargs), FrontendConfig(**dict(config or {})))

    @fastapi_app.websocket("/v1/stream")
    async def stream(self, ws: WebSocket) -> None:
        await self.frontend.serve(ws)

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        return Response(await self.frontend.metrics_text(), media_type=prom.CONTENT_TYPE_LATEST)


def app(factory: str | Callable[..., Any] = "cadence_fx.serve.local_backend:demo_backend",
        kwargs: Mapping[str, Any] | None = None, config: FrontendConfig | Mapping[str, Any] | None = None,
        **options: Any) -> Any:
    """The bound application (``serve.run(app(...), route_prefix="/")``); ``options`` go to
    ``StreamDeployment.options`` (``num_replicas``, ``max_ongoing_requests``, ``ray_actor_options``)."""
    config = asdict(config) if isinstance(config, FrontendConfig) else dict(config or {})
    deployment: Any = StreamDeployment  # a serve Deployment (the decorator's), typed as the class
    deployment = deployment.options(**options) if options else deployment
    return deployment.bind(factory, dict(kwargs or {}), config)


def build_app(args: dict[str, str]) -> Any:
    """``serve run cadence_fx.serve.frontend:build_app factory=module:attr deadline_ms=250 ...``: the
    ``factory`` key picks the backend, the :class:`FrontendConfig` fields set the limits, any other
    key is passed to the factory (numbers parsed)."""
    args = dict(args)
    factory = args.pop("factory", "cadence_fx.serve.local_backend:demo_backend")
    fields = FrontendConfig.__dataclass_fields__
    config = {k: _number(args.pop(k)) for k in list(args) if k in fields}
    return app(factory, {k: _number(v) for k, v in args.items()}, config)


def _number(v: str) -> Any:
    for kind in (int, float):
        try:
            return kind(v)
        except (TypeError, ValueError):
            pass
    return v
