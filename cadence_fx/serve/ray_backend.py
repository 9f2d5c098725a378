"""The front end's backend over Ray workers: the five methods of ``ConversationBackend``, one hop per chunk.

The streaming front end (:mod:`cadence_fx.serve.frontend`) talks to whatever runs the steps through
:class:`~cadence_fx.serve.protocol.ConversationBackend`. :class:`RayBackend` is that seam for the
distributed core, through a :class:`~cadence_fx.serve.router.Router` in the replica's process: a
chunk goes straight to the worker holding its conversation (one actor hop), the other methods to
the controller (placement, moves, checkpoints and failover stay there). The router keeps each of
its conversations' journals since their last checkpoint, so a conversation is served by the replica
that opened it (its connection's, as the protocol has it anyway). Each refusal is mapped to the
protocol's code: unknown and closed conversations, a wrong sequence number, admission refused
(``TOO_MANY_CONVERSATIONS``), a prompt the catalog does not have, a restore token it does not hold.
Snapshots stay in Ray's object store under the controller (:mod:`cadence_fx.serve.turns`); the
client gets an opaque token.

The methods are ``async`` (the front end awaits them on its event loop: an actor call is a wait, not
work). :func:`ray_backend` connects to a running controller; :func:`demo_ray_backend` starts one over
the demo decoder (an artifact saved once, workers loaded from it) for tests and a first run.
"""

from __future__ import annotations

import functools
import importlib
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

import ray
import torch
from ray.exceptions import RayTaskError

from cadence_fx.artifact import save
from cadence_fx.program import optimize
from cadence_fx.serve import wire
from cadence_fx.serve.controller import CONTROLLER_NAME, get_controller, start_controller
from cadence_fx.serve.conversation import (AdmissionRefused, ConversationClosed, SequenceError,
                                           UnknownConversation, UnknownSnapshot)
from cadence_fx.serve.protocol import ErrorCode, ProtocolError, TensorSpec, spec_to_json
from cadence_fx.serve.router import Router
from cadence_fx.serve.worker import WorkerConfig

__all__ = ["RayBackend", "demo_prompt", "demo_ray_backend", "ray_backend"]

Prompt = Callable[[int | None], Sequence[torch.Tensor] | Mapping[str, torch.Tensor]]

_CODES: tuple[tuple[type[BaseException], ErrorCode], ...] = (  # the first match wins: closed before unknown
    (ConversationClosed, ErrorCode.CONVERSATION_CLOSED),
    (UnknownConversation, ErrorCode.UNKNOWN_CONVERSATION),
    (SequenceError, ErrorCode.BAD_SEQUENCE),
    (AdmissionRefused, ErrorCode.TOO_MANY_CONVERSATIONS),
    (UnknownSnapshot, ErrorCode.UNKNOWN_SNAPSHOT),
)


def _cause(e: BaseException) -> BaseException:
    """The worker's or controller's own exception under Ray's wrappers (one per actor hop)."""
    while isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    return e


async def _translated(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as e:
        cause = _cause(e)
        for cls, code in _CODES:
            if isinstance(e, cls) or isinstance(cause, cls):
                raise ProtocolError(code, str(cause)) from None
        raise


class RayBackend:
    """Conversations on the controller ``controller`` (an actor handle).

    Args:
        chunk_inputs: what each chunk carries, in order (:meth:`ServeController.example` gives them).
        prompt: ``prompt(id or None) -> initial state`` (per region, in contract order or by name);
            a ``KeyError``, ``IndexError`` or ``ValueError`` from it is ``BAD_PROMPT``. ``None``: the
            workers' default initial state (zeros of the first class) for every conversation.
        router: the :class:`Router` chunks go through (default: a new one over ``controller``).
    Snapshots are kept by the controller (its last ``Turns.max_snapshots`` per conversation, 8).
    """

    def __init__(self, controller: Any, chunk_inputs: Sequence[TensorSpec], prompt: Prompt | None = None, *,
                 router: Router | None = None) -> None:
        wire.install()
        self.controller = controller
        self.router = router if router is not None else Router(controller)
        self.chunk_inputs = list(chunk_inputs)
        self.prompt = prompt

    async def open(self, conv_id: str, seed: int | None, prompt: int | None = None) -> dict[str, Any]:
        state = None
        if self.prompt is not None:
            try:
                state = self.prompt(prompt)
            except (KeyError, IndexError, ValueError) as e:
                raise ProtocolError(ErrorCode.BAD_PROMPT, f"prompt {prompt!r}: {e}") from None
        elif prompt is not None:
            raise ProtocolError(ErrorCode.BAD_PROMPT, "this backend has no prompts")
        opened = await _translated(self.router.aopen(conv_id, seed, state))
        return {"inputs": spec_to_json(self.chunk_inputs), "worker": opened["worker"], "seed": opened["seed"]}

    async def step(self, conv_id: str, seq: int, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        res = await _translated(self.router.astep(conv_id, seq, list(inputs)))
        return list(res.outputs)

    async def snapshot(self, conv_id: str) -> str:
        kept: dict[str, Any] = await _translated(self.router.akeep_snapshot(conv_id))
        return str(kept["token"])  # the state stays in the object store, under the controller

    async def restore(self, conv_id: str, token: str) -> int:
        seq: int = await _translated(self.router.arestore(conv_id, token))
        return seq

    async def close(self, conv_id: str) -> None:
        try:
            await _translated(self.router.aclose(conv_id))
        except ProtocolError as e:  # closing a closed (or never opened) conversation is a no-op
            if e.code not in (ErrorCode.CONVERSATION_CLOSED, ErrorCode.UNKNOWN_CONVERSATION):
                raise

    def open_count(self) -> int:
        """Conversations this backend opened and has not closed."""
        return self.router.open_count()


def _resolve(obj: Any) -> Any:
    if isinstance(obj, str) and ":" in obj:
        module, attr = obj.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    return obj


def ray_backend(controller: str = CONTROLLER_NAME, *, namespace: str | None = None, prompt: Any = None) -> RayBackend:
    """A backend over the running controller named ``controller`` (``prompt``: a callable, or
    ``"module:attr"`` naming one). The chunk spec is read off a live worker."""
    handle = get_controller(controller, namespace)
    chunk, _state = ray.get(handle.example.remote())
    specs = [TensorSpec.of(name, t) for name, t in chunk.items()]
    return RayBackend(handle, specs, _resolve(prompt))


def demo_prompt(p: int | None, *, dim: int = 16, chunk: int = 4, prompts: int = 1000) -> list[torch.Tensor]:
    """Prompt ``p`` of the demo decoder (:func:`cadence_fx.serve.local_backend.demo_backend`'s):
    ``initial_state() + p * 0.01`` (the initial state does not depend on the weights)."""
    p = 0 if p is None else p
    if not 0 <= p < prompts:
        raise ValueError(f"the demo has prompts 0 to {prompts - 1}")
    return [s + p * 0.01 for s in _demo_initial(dim, chunk)]


@functools.lru_cache(maxsize=8)
def _demo_initial(dim: int, chunk: int) -> tuple[torch.Tensor, ...]:
    from cadence_fx.testing import demo_model as demo  # deferred: the demo model is for tests and first runs

    with torch.random.fork_rng():  # building the model draws its weights: the process's stream is left alone
        return tuple(demo.StreamingDecoder(demo.DemoConfig(dim=dim, chunk=chunk)).initial_state())


def demo_ray_backend(*, workers: int = 2, dim: int = 16, chunk: int = 4, lanes: int = 1, capacity: int = 8,
                     prompts: int = 1000, worker_cpus: float = 0.5, controller: str = CONTROLLER_NAME,
                     folder: str | None = None) -> RayBackend:
    """A :class:`RayBackend` over the demo decoder: the catalog exported, optimized and saved once (in
    ``folder``, a temporary one by default), ``workers`` workers loaded from it (replay off, the CPU),
    under a controller named ``controller`` (reused when one is running). Prompts as
    :func:`cadence_fx.serve.local_backend.demo_backend`'s: ``initial_state() + p * 0.01``."""
    from cadence_fx.testing import demo_model as demo  # deferred: the demo model is for tests and first runs

    try:
        handle = get_controller(controller)
    except ValueError:  # none running: build the artifact and start one
        cfg = demo.DemoConfig(dim=dim, chunk=chunk)
        torch.manual_seed(0)
        model = demo.StreamingDecoder(cfg).eval()
        contract = demo.demo_contract(cfg)
        path = Path(folder or tempfile.mkdtemp(prefix="cadence-demo-")) / f"demo-{dim}-{chunk}.cfx"
        info = save(optimize(demo.export_catalog(model, contract), contract, replay="off"), path)
        config = WorkerConfig(str(path), sha256=info["sha256"], lanes=lanes, replay="off", capacity=capacity,
                              threads=1)
        handle = start_controller([config] * workers, name=controller, worker_options={"num_cpus": worker_cpus})

    def prompt(p: int | None) -> list[torch.Tensor]:
        return demo_prompt(p, dim=dim, chunk=chunk, prompts=prompts)

    chunk_spec, _state = ray.get(handle.example.remote())
    return RayBackend(handle, [TensorSpec.of(n, t) for n, t in chunk_spec.items()], prompt)
