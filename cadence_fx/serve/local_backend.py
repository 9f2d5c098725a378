"""An in-process :class:`~cadence_fx.serve.protocol.ConversationBackend` over one program's sessions.

Each conversation is one :class:`cadence_fx.Session` of one :class:`cadence_fx.OptimizedProgram`:
the backend keeps the state each call returns and feeds it to the next, so a chunk carries only the
step's other inputs and its reply only the step's other outputs, and every conversation's stream is
the unmodified program's on its own state. Snapshots are kept here (a few per conversation) under
opaque tokens.

:func:`demo_backend` builds one over the demo decoder (:mod:`cadence_fx.testing.demo_model`), for
the tests, the benchmark and a first run of the server.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from cadence_fx.program import OptimizedProgram, optimize
from cadence_fx.runtime.sessions import Session, Snapshot
from cadence_fx.serve.protocol import ErrorCode, ProtocolError, TensorSpec, spec_to_json

__all__ = ["LocalBackend", "chunk_specs", "demo_backend"]

Prompt = Callable[[int | None], Sequence[torch.Tensor] | Mapping[str, torch.Tensor]]


def chunk_specs(program: OptimizedProgram, example: Sequence[torch.Tensor]) -> list[TensorSpec]:
    """What a chunk carries: the program's inputs that are not state, shaped as in ``example`` (one
    full call's arguments, in the program's order)."""
    state = {r.input for r in program.contract.regions}
    return [TensorSpec.of(name, t) for name, t in zip(program.input_names, example) if name not in state]


@dataclass
class _Conversation:
    session: Session
    state: dict[str, torch.Tensor]  # what the next call reads, by region (the last call's state views)
    seq: int = 0
    snapshots: "OrderedDict[str, tuple[Snapshot, int]]" = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class LocalBackend:
    """Conversations as sessions of ``program``.

    Args:
        program: an optimized program with the state rule (sessions).
        chunk_inputs: what each chunk carries (:func:`chunk_specs`), in the program's order.
        prompt: ``prompt(id or None) -> initial state`` (per region, in the contract's order or by
            name); a ``KeyError``, ``IndexError`` or ``ValueError`` from it is a ``BAD_PROMPT``.
        max_conversations: open conversations at most (``TOO_MANY_CONVERSATIONS`` past it).
        max_snapshots: snapshots kept per conversation; the oldest is dropped past it.
    """

    def __init__(self, program: OptimizedProgram, chunk_inputs: Sequence[TensorSpec], prompt: Prompt, *,
                 max_conversations: int = 64, max_snapshots: int = 8) -> None:
        self.program = program
        self.chunk_inputs = list(chunk_inputs)
        self.prompt = prompt
        self.max_conversations = max_conversations
        self.max_snapshots = max_snapshots
        self.regions = list(program.contract.regions)
        names = program.input_names
        missing = [r.input for r in self.regions if r.input not in names]
        if missing:
            raise ValueError(f"LocalBackend: region input(s) {missing} are not program inputs (kept in module "
                             f"buffers): not supported")
        self._region_of = {r.input: r.name for r in self.regions}
        if [s.name for s in self.chunk_inputs] != [n for n in names if n not in self._region_of]:
            raise ValueError(f"LocalBackend: chunk inputs {[s.name for s in self.chunk_inputs]} are not the "
                             f"program's non-state inputs {[n for n in names if n not in self._region_of]}")
        self._output_of = {r.name: int(r.output) for r in self.regions if r.output is not None}
        if len(self._output_of) < len(self.regions):
            raise ValueError("LocalBackend: every region needs its output index")
        self._state_outputs = set(self._output_of.values())
        self._convs: dict[str, _Conversation] = {}
        self._lock = threading.Lock()
        self.closed_total = 0

    # ------------------------------------------------------------------ the five methods
    def open(self, conv_id: str, seed: int | None, prompt: int | None = None) -> dict[str, Any]:
        state = self._initial_state(conv_id, prompt)
        with self._lock:
            if conv_id in self._convs:
                raise ValueError(f"conversation {conv_id!r} is already open")
            if len(self._convs) >= self.max_conversations:
                raise ProtocolError(ErrorCode.TOO_MANY_CONVERSATIONS,
                                    f"{len(self._convs)} conversations open (at most {self.max_conversations})")
            self._convs[conv_id] = _Conversation(self.program.session(conv_id, seed=seed), state)
        return {"inputs": spec_to_json(self.chunk_inputs)}

    def step(self, conv_id: str, seq: int, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        conv = self._get(conv_id)
        with conv.lock:
            if seq != conv.seq:
                raise ProtocolError(ErrorCode.BAD_SEQUENCE, f"chunk {seq}, expected {conv.seq}")
            if len(inputs) != len(self.chunk_inputs):
                raise ProtocolError(ErrorCode.WRONG_ARITY, f"{len(inputs)} inputs, expected {len(self.chunk_inputs)}")
            chunk = iter(inputs)
            args = [conv.state[self._region_of[n]] if n in self._region_of else next(chunk)
                    for n in self.program.input_names]
            out = conv.session(*args)  # raises: the session is as it was (a transaction)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            conv.state = {name: outs[j] for name, j in self._output_of.items()}
            conv.seq += 1
            return [t for j, t in enumerate(outs) if j not in self._state_outputs]

    def snapshot(self, conv_id: str) -> str:
        conv = self._get(conv_id)
        with conv.lock:
            snap = conv.session.snapshot()
            if not snap.state:  # no call yet: the state is the prompt's, which the session never saw
                snap = Snapshot({n: t.clone() for n, t in conv.state.items()}, snap.rng)
            token = secrets.token_urlsafe(12)
            conv.snapshots[token] = (snap, conv.seq)
            while len(conv.snapshots) > self.max_snapshots:
                conv.snapshots.popitem(last=False)
            return token

    def restore(self, conv_id: str, token: str) -> int:
        """Back to snapshot ``token``; returns the sequence number of the next chunk."""
        conv = self._get(conv_id)
        with conv.lock:
            if token not in conv.snapshots:
                raise ProtocolError(ErrorCode.UNKNOWN_SNAPSHOT, f"conversation {conv_id!r} holds no snapshot "
                                    f"{token!r:.40} (it keeps the last {self.max_snapshots})")
            snap, seq = conv.snapshots[token]
            conv.state = conv.session.restore(snap)
            conv.seq = seq
            return seq

    def close(self, conv_id: str) -> None:
        with self._lock:
            conv = self._convs.pop(conv_id, None)
        if conv is not None:
            with conv.lock:  # after a chunk still running
                conv.session.close()
                conv.snapshots.clear()
            self.closed_total += 1

    # ------------------------------------------------------------------ introspection
    def open_count(self) -> int:
        """Conversations open (each holds one session)."""
        with self._lock:
            return len(self._convs)

    def _get(self, conv_id: str) -> _Conversation:
        with self._lock:
            conv = self._convs.get(conv_id)
        if conv is None:
            raise ProtocolError(ErrorCode.UNKNOWN_CONVERSATION, f"no open conversation {conv_id!r}")
        return conv

    def _initial_state(self, conv_id: str, prompt: int | None) -> dict[str, torch.Tensor]:
        try:
            state = self.prompt(prompt)
        except (KeyError, IndexError, ValueError) as e:
            raise ProtocolError(ErrorCode.BAD_PROMPT, f"prompt {prompt!r}: {e}") from None
        if not isinstance(state, Mapping):
            state = dict(zip([r.name for r in self.regions], state))
        if sorted(state) != sorted(r.name for r in self.regions):
            raise ValueError(f"prompt {prompt!r} gave state for {sorted(state)}, the regions are "
                             f"{sorted(r.name for r in self.regions)}")
        return dict(state)


def demo_backend(*, dim: int = 16, chunk: int = 4, lanes: int = 1, replay: str = "off", prompts: int = 1000,
                 threads: int | None = None, max_conversations: int = 64) -> LocalBackend:
    """A :class:`LocalBackend` over the demo decoder on the CPU, built as the tests build it
    (``torch.manual_seed(0)``, ``DemoConfig(dim, chunk)``, the exported catalog): chunks carry
    ``tokens`` and ``noise`` of shape ``(1, chunk, dim)``, replies the frames. Prompt ``p`` (0 <= p <
    ``prompts``; none is 0) starts from ``initial_state() + p * 0.01``. ``threads`` pins torch's
    intra-op threads in this process."""
    from cadence_fx.testing import demo_model as demo  # deferred: the demo model is for tests and first runs only

    if threads is not None:
        torch.set_num_threads(threads)
    cfg = demo.DemoConfig(dim=dim, chunk=chunk)
    torch.manual_seed(0)
    model = demo.StreamingDecoder(cfg).eval()
    contract = demo.demo_contract(cfg)
    program = optimize(demo.export_catalog(model, contract), contract, replay=replay, lanes=lanes)
    initial = model.initial_state()

    def prompt(p: int | None) -> list[torch.Tensor]:
        p = 0 if p is None else p
        if not 0 <= p < prompts:
            raise ValueError(f"the demo has prompts 0 to {prompts - 1}")
        return [s + p * 0.01 for s in initial]

    example = demo.example_args(cfg, cfg.prompt, cfg.prompt)
    return LocalBackend(program, chunk_specs(program, example), prompt, max_conversations=max_conversations)
