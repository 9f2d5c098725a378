"""The exported steps: one frame of ``LMGen`` (temporal transformer + depformer + sampling), and one
frame of Mimi's streaming decode and encode, each with its streaming state as explicit tensors.

Each step is a functional wrapper over the upstream module in streaming mode: ``forward(x, *state)``
installs the state tensors passed in (:mod:`cadence_fx.adapters.moshi.state`), runs the upstream
entry point unchanged (``LMGen._step``, ``MimiModel.decode``, ``MimiModel.encode``) and returns
``(y, *state')``. What upstream writes in place (the ring KV caches, ``previous[:] = ...``) comes
back as the input tensor written in place; what it replaces (``state.offsets = torch.where(...)``)
comes back as a new tensor. State input ``state_i`` is :attr:`MoshiStep.slots` ``[i]``, and output
``1 + i`` carries it to the next call.

Upstream's own acceleration is off inside the steps (``no_compile``: ``torch.compile`` of the RMS
norm, RoPE and gating kernels would change kernels and bits; ``no_cuda_graph``: its
``CUDAGraphed`` wrappers would capture during export); the stock eager run does the same, and the
vendor cell of ``benchmarks/moshi.py`` turns only ``CUDAGraphed`` back on.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch import nn

from cadence_fx.adapters.moshi.state import StateSlot, read_state, state_slots, write_state
from cadence_fx.adapters.streaming import StreamingStep
from cadence_fx.contract import Contract

__all__ = ["LMStep", "MimiDecodeStep", "MimiEncodeStep", "MoshiStep", "upstream_eager"]


@contextlib.contextmanager
def upstream_eager(up: types.SimpleNamespace, *, cuda_graph: bool = False) -> Iterator[None]:
    """Upstream code as the exported steps run it: no ``torch.compile``; no ``CUDAGraphed`` capture
    unless ``cuda_graph`` (the vendor's replay as shipped)."""
    with up.compile.no_compile(), (contextlib.nullcontext() if cuda_graph else up.compile.no_cuda_graph()):
        yield


class MoshiStep(StreamingStep):
    """A step over one upstream streaming module: ``(x, state_0, ..., state_{n-1}) -> (y, state_0', ...)``.

    The per-call input is ``x`` in the exported program (the argument's name in :meth:`forward`):
    audio codes for :class:`LMStep` and :class:`MimiDecodeStep`, PCM for :class:`MimiEncodeStep`.
    Subclasses implement :meth:`_run`.
    """

    def __init__(self, module: nn.Module, up: types.SimpleNamespace, slots: list[StateSlot]) -> None:
        super().__init__()
        self.module = module
        self.up = up
        self.slots = slots
        # the state right after ``streaming()`` was entered: the stream's start. Upstream fills every
        # tensor with one value (zeros, ones, ``ungenerated_token_id``), so most are kept as that value:
        # a copy of the released LM's 1.6 GB of rings would sit on the GPU next to the program's own.
        self._initial = {s.name: _Initial.of(s.get()) for s in slots}
        names = tuple(f"state_{i}" for i in range(len(slots)))
        self.inputs = ("x", *names)
        self.state = {n: 1 + i for i, n in enumerate(names)}

    def slot_of(self, input_name: str) -> StateSlot:
        """The upstream slot behind state input ``input_name`` (``state_i``)."""
        return self.slots[self.inputs.index(input_name) - 1]

    def initial_state(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The state at the start of a stream, by input name (new tensors; on the device the module
        streams on, or on ``device``)."""
        return {f"state_{i}": self._initial[s.name].make(device) for i, s in enumerate(self.slots)}

    def release_state(self) -> int:
        """Replace the upstream objects' state tensors by empty ones (freeing them); returns the bytes.

        For a deployment that serves the step through an optimized program, which owns the state:
        the module's own copy (the released LM's rings: 1.6 GB) would otherwise stay allocated.
        :meth:`forward` installs the state it is given, so the step still runs afterwards.
        """
        freed = 0
        for slot in self.slots:
            t = slot.get()
            freed += t.numel() * t.element_size()
            slot.set(t.new_empty(0))
        return freed

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(state) != len(self.slots):
            raise TypeError(f"{type(self).__name__}: {len(self.slots)} state tensors expected, got {len(state)}")
        for slot, t in zip(self.slots, state):
            slot.set(t)
        with upstream_eager(self.up):
            y = self._run(x)
        return (y, *[slot.get() for slot in self.slots])

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def export_context(self, contract: Contract, granularity: str | None = None) -> contextlib.AbstractContextManager:
        """Export installs fake tensors into the upstream state objects: put the real ones back after."""
        return _state_restored(self.slots)


class _Initial:
    """One initial state tensor: a fill value and a shape when upstream filled it with one value,
    else a host copy."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, fill: object,
                 host: torch.Tensor | None) -> None:
        self.shape, self.dtype, self.device, self.fill, self.host = shape, dtype, device, fill, host

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Initial":
        t = t.detach()
        if t.device.type == "meta":  # a module built on the meta device (planning, export timing): no values
            return cls(t.shape, t.dtype, t.device, 0, None)
        if t.numel() and bool((t == t.reshape(-1)[0]).all()):
            return cls(t.shape, t.dtype, t.device, t.reshape(-1)[0].item(), None)
        return cls(t.shape, t.dtype, t.device, None, t.to("cpu", copy=True))

    def make(self, device: torch.device | str | None = None) -> torch.Tensor:
        dev = self.device if device is None else torch.device(device)
        if self.host is not None:
            return self.host.to(dev, copy=True)
        return torch.full(self.shape, self.fill, dtype=self.dtype, device=dev)


@contextlib.contextmanager
def _state_restored(slots: list[StateSlot]) -> Iterator[None]:
    saved = read_state(slots)
    try:
        yield
    finally:
        write_state(slots, saved)


class LMStep(MoshiStep):
    """One frame of ``LMGen``: ``(codes, *state) -> (tokens, *state')``.

    ``codes`` (input ``x``) are the user stream's audio codes ``(B, n_q - dep_q, 1)`` (Mimi's encoding of the input
    audio). ``tokens`` is what ``LMGen.step`` returns, ``(B, 1 + dep_q, 1)``: the sampled text token
    and the model's ``dep_q`` audio codes, realigned across the delays. On the first ``max_delay``
    frames, where ``LMGen.step`` returns ``None``, the step returns the same tensor with every entry
    ``ungenerated_token_id`` (-2): ``LMGen``'s own device-side mask, which the step reaches by running
    with ``support_out_of_sync`` on (its only effect in 0.2.13 is that host-side ``return None``,
    decided on a Python counter that export would bake in).

    Sampling draws from the default generator of the LM's device (``exponential_`` in
    ``moshi.utils.sampling.multinomial``), in the order eager ``LMGen.step`` draws.
    The state: per temporal-transformer layer the ring KV cache ``(2, B, heads, context, head_dim)``,
    its write counter and the attention's position; the transformer's position; ``LMGen``'s delayed
    token ring ``(B, 1 + n_q, max_delay + 2)`` and its frame counter. The depformer's caches live
    within one frame (``LMGen`` re-enters its streaming every frame) and are not state.
    """

    def __init__(self, gen: nn.Module, up: types.SimpleNamespace, *, batch_size: int = 1) -> None:
        if gen._streaming_state is None:
            gen.streaming_forever(batch_size)
        super().__init__(gen, up, state_slots(gen, up))

    @property
    def gen(self) -> nn.Module:
        return self.module

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        gen = self.module
        saved = gen.support_out_of_sync
        gen.support_out_of_sync = True
        try:
            tokens, _transformer_out = gen._step(codes)
        finally:
            gen.support_out_of_sync = saved
        return tokens

    def as_tokens(self, out: torch.Tensor | None, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """``LMGen.step``'s output as the step returns it: ``None`` becomes all ``ungenerated_token_id``."""
        if out is not None:
            return out
        lm = self.module.lm_model
        return torch.full((batch_size, lm.dep_q + 1, 1), lm.ungenerated_token_id, dtype=torch.long, device=device)

    def codes_shape(self) -> tuple[int, int, int]:
        """Shape of the per-frame ``codes`` input."""
        lm = self.module.lm_model
        return (self.module._streaming_state.batch_size, lm.num_codebooks - lm.dep_q - 1, 1)

    def fresh(self, n_calls: int, *, seed: int = 0, device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
        """Per-frame inputs ``{"x": codes}``: random user audio codes (what Mimi's encoder would give)."""
        g = torch.Generator().manual_seed(seed)
        card = self.module.lm_model.card
        return [{"x": torch.randint(0, card, self.codes_shape(), generator=g).to(device)} for _ in range(n_calls)]


def _mimi_slots(mimi: nn.Module, up: types.SimpleNamespace, side: str, batch_size: int) -> list[StateSlot]:
    if mimi._streaming_state is None:
        mimi.streaming_forever(batch_size)
    prefixes = ("encoder", "downsample") if side == "encode" else ("upsample", "decoder")
    return state_slots(mimi, up, prefixes=prefixes)  # "encoder"/"decoder" also match the *_transformer


class MimiDecodeStep(MoshiStep):
    """One frame of ``MimiModel.decode`` in streaming mode: ``(codes (B, K, 1), *state) -> (pcm (B, 1, 1920), *state')``.

    The state: the upsampler's transposed-conv overlap, the decoder transformer's ring KV caches
    (context 250 frames released) and counters, every SEANet decoder conv's left context and every
    transposed conv's overlap.
    """

    def __init__(self, mimi: nn.Module, up: types.SimpleNamespace, *, batch_size: int = 1) -> None:
        super().__init__(mimi, up, _mimi_slots(mimi, up, "decode", batch_size))

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        return self.module.decode(codes)


class MimiEncodeStep(MoshiStep):
    """One frame of ``MimiModel.encode`` in streaming mode: ``(pcm (B, 1, 1920), *state) -> (codes (B, K, 1), *state')``.

    The state: every SEANet encoder conv's left context, the encoder transformer's rings and
    counters, the downsampler's left context and its first-call flag (replicate padding).
    """

    def __init__(self, mimi: nn.Module, up: types.SimpleNamespace, *, batch_size: int = 1) -> None:
        super().__init__(mimi, up, _mimi_slots(mimi, up, "encode", batch_size))

    def _run(self, pcm: torch.Tensor) -> torch.Tensor:
        return self.module.encode(pcm)

    def fresh(self, n_calls: int, *, seed: int = 0, device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
        """Per-frame inputs ``{"x": pcm}``: frames of noise-like audio (0.1 * N(0, 1))."""
        g = torch.Generator().manual_seed(seed)
        b = self.module._streaming_state.batch_size
        n = self.module.frame_size
        return [{"x": (0.1 * torch.randn(b, 1, n, generator=g)).to(device)} for _ in range(n_calls)]
