"""Per-chunk latency the streaming front end adds: WebSocket round trip minus the backend's step.

    python benchmarks/serve_frontend.py [--conversations 1 4] [--chunks 200] [--warm 20] [--dim 16]

Serves ``cadence_fx.serve.frontend`` on Ray Serve (a local Ray of ``--cpus`` CPUs) over
:func:`cadence_fx.serve.local_backend.demo_backend` (the demo decoder on the CPU, replay off), and
runs N conversations at once, each a client of its own connection sending its next chunk when the
last one's reply is in (``--warm`` chunks first, not counted). Per chunk: the round trip the client
sees (send to reply decoded), the backend's step (the ``micros`` the reply carries), and their
difference, what the front end adds: the client's encoding and decoding, the WebSocket hops through
the Serve proxy to the replica and back, the frame checks, the thread-pool hand-off and the reply's
encoding. Prints p50/p99 per N (and ``--json PATH`` writes them). ``--backend echo`` serves a backend
whose step hands the tokens back at once: the front end and transport alone, no model beside them on
the CPU; ``--backend bare`` a Serve deployment that echoes each binary message with no protocol at all
(what Ray Serve's WebSocket path costs by itself; "backend step" is then 0).
"""

# no ``from __future__ import annotations``: FastAPI reads the echo handler's annotation at run time
import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cadence_fx.serve.protocol import DEADLINE_MISSED, StreamClient  # noqa: E402


class EchoBackend:
    """The five methods, no model: a step returns its first input (the transport's cost alone)."""

    def __init__(self, dim: int, chunk: int, **_: object) -> None:
        self.inputs = [{"name": n, "dtype": "float32", "shape": [1, chunk, dim]} for n in ("tokens", "noise")]
        self.convs: set[str] = set()

    def open(self, conv_id, seed, prompt=None):
        self.convs.add(conv_id)
        return {"inputs": self.inputs}

    def step(self, conv_id, seq, inputs):
        return [inputs[0]]

    def snapshot(self, conv_id):
        return "none"

    def restore(self, conv_id, token):
        return None

    def close(self, conv_id):
        self.convs.discard(conv_id)


def _inputs(dim: int, chunk: int, seed: int, k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + k)
    return [torch.randn(1, chunk, dim, generator=g), torch.randn(1, chunk, dim, generator=g)]


def _bare_app():
    """A deployment that echoes every binary message: Ray Serve's WebSocket round trip alone."""
    from fastapi import FastAPI, WebSocket  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=64)
    @serve.ingress(app)
    class Bare:
        @app.websocket("/v1/stream")
        async def echo(self, ws: WebSocket):  # noqa: ANN201
            await ws.accept()
            while (m := await ws.receive())["type"] != "websocket.disconnect":
                await ws.send_bytes(m["bytes"])

    return Bare.bind()


async def _conversation(url: str, seed: int, args: argparse.Namespace) -> list[tuple[float, float, bool]]:
    import websockets  # noqa: PLC0415

    from cadence_fx.serve.protocol import CHUNK, encode_frame  # noqa: PLC0415

    rows = []
    async with websockets.connect(url, max_size=None) as ws:
        if args.backend == "bare":
            for k in range(args.warm + args.chunks):
                t = time.perf_counter()
                await ws.send(encode_frame(CHUNK, 1, k, _inputs(args.dim, args.chunk, seed, k)))
                await ws.recv()
                if k >= args.warm:
                    rows.append((time.perf_counter() - t, 0.0, False))
            return rows
        client = StreamClient(ws)
        conv = (await client.open(seed=seed, prompt=seed, deadline_ms=args.deadline_ms))["conv"]
        for k in range(args.warm + args.chunks):
            x = _inputs(args.dim, args.chunk, seed, k)
            t = time.perf_counter()
            frame = await client.chunk(conv, k, x)
            rtt = time.perf_counter() - t
            if k >= args.warm:
                rows.append((rtt, frame.micros / 1e6, bool(frame.flags & DEADLINE_MISSED)))
        await client.close(conv)
    return rows


def _pcts(xs) -> dict[str, float]:
    xs = np.asarray(xs) * 1e3
    return {"p50_ms": round(float(np.percentile(xs, 50)), 3), "p99_ms": round(float(np.percentile(xs, 99)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--chunks", type=int, default=200, help="timed chunks per conversation")
    ap.add_argument("--warm", type=int, default=20, help="untimed chunks first, per conversation")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--deadline-ms", type=float, default=250.0)
    ap.add_argument("--backend", choices=["demo", "echo", "bare"], default="demo")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from cadence_fx.serve import frontend  # noqa: PLC0415

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    factory = EchoBackend if args.backend == "echo" else "cadence_fx.serve.local_backend:demo_backend"
    kwargs = {"dim": args.dim, "chunk": args.chunk} if args.backend == "echo" else \
        {"dim": args.dim, "chunk": args.chunk, "lanes": args.lanes}
    app = _bare_app() if args.backend == "bare" else \
        frontend.app(factory, kwargs, config={"max_in_flight": max(args.conversations)})
    serve.run(app, name="bench", route_prefix="/")
    url = f"ws://127.0.0.1:{port}/v1/stream"
    results = {"device": "cpu", "cpus": args.cpus, "host_cores": os.cpu_count(), "machine": platform.processor(),
               "torch": torch.__version__, "ray": ray.__version__, "dim": args.dim, "chunk": args.chunk,
               "lanes": args.lanes, "chunks": args.chunks, "backend": args.backend, "rows": []}
    try:
        for n in args.conversations:
            async def run_all(n=n):
                return await asyncio.gather(*(_conversation(url, 100 + i, args) for i in range(n)))
            rows = [r for conv in asyncio.run(run_all()) for r in conv]
            rtt, step, missed = (np.array([r[i] for r in rows]) for i in range(3))
            row = {"conversations": n, "samples": len(rows), "round_trip": _pcts(rtt), "backend_step": _pcts(step),
                   "added": _pcts(rtt - step), "deadline_missed": int(missed.sum())}
            results["rows"].append(row)
            print(f"N={n}: added by the front end p50 {row['added']['p50_ms']:.2f} ms p99 {row['added']['p99_ms']:.2f} "
                  f"ms | round trip p50 {row['round_trip']['p50_ms']:.2f} p99 {row['round_trip']['p99_ms']:.2f} | "
                  f"backend step p50 {row['backend_step']['p50_ms']:.2f} p99 {row['backend_step']['p99_ms']:.2f} | "
                  f"{row['samples']} chunks, {row['deadline_missed']} past {args.deadline_ms:g} ms", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
