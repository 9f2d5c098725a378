"""The 1.0.7 causal vocoder (``BoundedVocoder`` over a ``CausalHiFTGenerator``) under replay.

``BoundedVocoder.stream`` is host-driven: integer offsets read with ``.item()`` choose slice bounds
and positions in a fixed noise table, so the stream as a whole is no finite catalog of static
programs. Its expensive part is not host-driven, though: ``CausalHiFTGenerator.decode(x, s,
finalize)`` is a stateless function of the bounded mel history and excitation, and after the first
few chunks its calls take a handful of shapes that repeat (one per internal block size).

:func:`replay_bounded_vocoder` exports ``decode`` once per shape seen while streaming example mel
through a scratch stream, optimizes that catalog with :func:`cadence_fx.optimize` (the decoder is
the wrapped callable; its ``istft`` runs eagerly between two replayed segments), captures it, and
installs a dispatcher as the model's ``decode``: a call whose shapes and ``finalize`` flag are in the
catalog runs the optimized program, any other runs the stock ``decode`` eagerly, counted by shape
and logged once. The vocoder's host bookkeeping, F0 predictor and excitation stay the stock code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

import cadence_fx as cf

log = logging.getLogger("cadence_fx.adapters.bounded_vocoder")

__all__ = ["ReplayedDecode", "replay_bounded_vocoder"]

# shapes, strides, 16-byte alignment of x and s, and the finalize flag: the replay engine keys on
# layout too (kernels may depend on it), and the vocoder passes views into its caches
Signature = tuple


def _signature(x: torch.Tensor, s: torch.Tensor, finalize: bool) -> Signature:
    return tuple((tuple(t.shape), t.stride(), t.data_ptr() % 16) for t in (x, s)) + (bool(finalize),)


def _same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in its own storage with the same shape, strides and offset (hence alignment)."""
    buf = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)
    out = buf.as_strided(t.shape, t.stride(), t.storage_offset())
    out.copy_(t)
    return out


class _Decode(nn.Module):
    """``hift.decode`` entered through ``__call__``, so the export records it as one module (``decoder``)."""

    def __init__(self, hift: nn.Module, finalize: bool) -> None:
        super().__init__()
        self.hift = hift
        self.finalize = finalize

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.hift.decode(x, s, finalize=self.finalize)


class _Step(nn.Module):
    def __init__(self, hift: nn.Module, finalize: bool) -> None:
        super().__init__()
        self.decoder = _Decode(hift, finalize)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.decoder(x, s)


@dataclass
class ReplayedDecode:
    """Installed as ``hift.decode``: the optimized catalog for the signatures it covers, else stock."""

    stock: Callable[..., torch.Tensor]
    programs: dict[bool, cf.OptimizedProgram]
    catalog: frozenset[Signature]
    optimized_calls: int = 0
    eager: dict[Signature, int] = field(default_factory=dict)

    def __call__(self, x: torch.Tensor, s: torch.Tensor = torch.zeros(1, 1, 0), finalize: bool = True) -> torch.Tensor:
        sig = _signature(x, s, finalize)
        if sig in self.catalog:
            self.optimized_calls += 1
            return self.programs[bool(finalize)](x, s)
        if sig not in self.eager:
            log.warning("decode signature %s is outside the catalog: stock decode, eagerly", sig)
        self.eager[sig] = self.eager.get(sig, 0) + 1
        return self.stock(x, s, finalize=finalize)

    def counters(self) -> dict[str, Any]:
        """Optimized calls, eager calls by signature, and the replay engines' counters."""
        return {"optimized": self.optimized_calls, "eager": dict(self.eager),
                "replay": {f: p.counters() for f, p in self.programs.items()}}


def replay_bounded_vocoder(vocoder: Any, example_mel: Sequence[torch.Tensor], *, replay: Any = "auto",
                           finalize: bool = False) -> ReplayedDecode:
    """Optimize and install ``vocoder.model.decode`` for the shapes ``example_mel`` produces.

    Args:
        vocoder: a 1.0.7 ``BoundedVocoder``; its own stream state is not touched (the example is
            streamed through a scratch ``BoundedVocoder`` over the same model).
        example_mel: mel chunks as the driver passes them to ``stream`` (``[1, 80, frames]``),
            enough for the decoder's shapes to start repeating (a few chunks).
        replay: as :func:`cadence_fx.optimize` (``"auto"``: CUDA graphs on a GPU, eager otherwise;
            or a backend object such as ``cadence_fx.testing.fake_backend.FakeBackend()``).
        finalize: also stream a final (flush) call, so its shapes join the catalog.

    Returns the installed :class:`ReplayedDecode` (its ``counters()`` say what ran how). Every
    output is bit-identical to the stock ``decode`` on the same inputs.
    """
    hift = vocoder.model
    stock = hift.decode
    if isinstance(stock, ReplayedDecode):
        stock = stock.stock
    seen: dict[Signature, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(x: torch.Tensor, s: torch.Tensor = torch.zeros(1, 1, 0), finalize: bool = True) -> torch.Tensor:
        seen.setdefault(_signature(x, s, finalize), (_same_layout_copy(x), _same_layout_copy(s)))
        return stock(x, s, finalize=finalize)

    scratch = type(vocoder)(hift, block_frames=vocoder.block_frames)
    hift.decode = record
    try:
        for k, mel in enumerate(example_mel):
            scratch.stream(mel, finalize=finalize and k == len(example_mel) - 1)
    finally:
        del hift.decode  # the instance attribute shadowed the method
    if not seen:
        raise ValueError("replay_bounded_vocoder: the example mel produced no decode call (too short)")

    programs: dict[bool, cf.OptimizedProgram] = {}
    for flag in sorted({sig[-1] for sig in seen}):
        examples = [ex for sig, ex in seen.items() if sig[-1] == flag]
        by_shape = {(tuple(x.shape), tuple(s.shape)): (x, s) for x, s in examples}  # one program per shape
        with torch.no_grad():
            eps = [torch.export.export(_Step(hift, flag), ex) for ex in by_shape.values()]
        contract = cf.Contract(clocks=(cf.Clock("frame", 1, "mel frames per decode call"),), wrap=("decoder",))
        prog = cf.optimize(eps, contract, replay=replay)
        with torch.inference_mode():  # BoundedVocoder.stream runs decode under inference mode
            for ex in examples:  # one capture per layout the stream passed (views of its caches)
                prog.warmup(*ex)
        programs[flag] = prog
    installed = ReplayedDecode(stock=stock, programs=programs, catalog=frozenset(seen))
    hift.decode = installed
    return installed
