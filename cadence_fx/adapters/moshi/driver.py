"""Driving a full-duplex Moshi stream, the stock way and through the exported steps.

One frame (80 ms, what ``moshi/server.py`` does per frame): Mimi encodes the user's 1920 samples
into ``n_q - dep_q`` codes, ``LMGen.step`` samples the text token and the model's audio codes,
and, once ``LMGen.step`` returns tokens (from frame ``max_delay`` on), Mimi decodes the model's codes
into 1920 samples. :func:`stock_stream` runs that with the upstream objects keeping their own state
(the code as shipped; ``cuda_graph`` turns on the vendor's ``CUDAGraphed`` replay),
:func:`step_stream` through callables with the steps' calling convention (the eager steps, the
unmodified exported programs, optimized programs, sessions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from cadence_fx.adapters.moshi.build import build_lm, build_lm_gen, build_mimi
from cadence_fx.adapters.moshi.state import write_state
from cadence_fx.adapters.moshi.steps import LMStep, MimiDecodeStep, MimiEncodeStep, MoshiStep, upstream_eager
from cadence_fx.runtime.backends import CudaGraphBackend

__all__ = ["Frame", "StreamSteps", "build_steps", "install_state", "reset_host_counters", "step_frame", "step_stream",
           "stock_frame", "stock_stream",
           "user_audio"]


@dataclass
class Frame:
    """What one frame emits: ``tokens`` ``(B, 1 + dep_q, 1)`` (text token, then the model's audio
    codes; all ``ungenerated_token_id`` before frame ``max_delay``) and ``pcm`` ``(B, 1, 1920)``
    (``None`` where there are no tokens to decode yet)."""

    tokens: torch.Tensor
    pcm: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        """The bytes the stream is judged on (hashed by the tests and the benchmark)."""
        return [self.tokens] + ([self.pcm] if self.pcm is not None else [])


@dataclass
class StreamSteps:
    """The three steps of a full-duplex stream over one ``LMGen`` and one Mimi."""

    encode: MimiEncodeStep
    lm: LMStep
    decode: MimiDecodeStep

    def initial_state(self, device: torch.device | str | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Each step's initial state (by step name, then input name)."""
        return {name: getattr(self, name).initial_state(device) for name in ("encode", "lm", "decode")}

    def examples(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """One frame's per-call input of each step, laid out as a stream passes it (zeros): the user's
        PCM, the user's codes, and the model's codes as a view of the LM's tokens (``tokens[:, 1:]``,
        not contiguous). Replay keys on strides, so a warm-up with these captures what traffic replays."""
        dev = self.lm.initial_state()["state_0"].device if device is None else device
        lm = self.lm.gen.lm_model
        b = self.lm.codes_shape()[0]
        tokens = torch.zeros(b, lm.dep_q + 1, 1, dtype=torch.long, device=dev)
        return {"encode": torch.zeros(b, 1, self.encode.module.frame_size, device=dev),
                "lm": torch.zeros(self.lm.codes_shape(), dtype=torch.long, device=dev), "decode": tokens[:, 1:]}

    @property
    def max_delay(self) -> int:
        """Frames before ``LMGen.step`` returns tokens."""
        return self.lm.gen.max_delay


def install_state(step: MoshiStep, state: Mapping[str, torch.Tensor]) -> None:
    """Put ``state`` (by input name, cloned) into the upstream module's streaming state, and zero its
    host-side counters: the module then continues the stream from ``state`` the stock way."""
    write_state(step.slots, {step.slot_of(name).name: t.clone() for name, t in state.items()})
    reset_host_counters(step.module)


def reset_host_counters(module: nn.Module) -> None:
    """Zero the Python-side frame counters (``offset_cpu``) of every streaming state under ``module``.

    ``LMGen.step`` returns ``None`` while its counter is at most ``max_delay``; the layers' counters
    pick per-step weights only in the depformer, whose streaming restarts every frame.
    """
    for mod in module.modules():
        st = getattr(mod, "_streaming_state", None)
        if st is not None and hasattr(st, "offset_cpu"):
            st.offset_cpu = 0


def stock_stream(steps: StreamSteps, state: Mapping[str, Mapping[str, torch.Tensor]], pcm: Sequence[torch.Tensor], *,
                 cuda_graph: bool = False, on_frame: Callable[[int, Frame], None] | None = None) -> list[Frame]:
    """The stream as moshi runs it: ``mimi.encode``, ``LMGen.step``, ``mimi.decode``, each module keeping
    its own streaming state (installed from ``state`` first). ``cuda_graph``: the vendor's
    ``CUDAGraphed`` replay as shipped (CUDA only), else eager (``NO_CUDA_GRAPH=1``).

    Raises ``RuntimeError`` if ``LMGen.step`` returns ``None`` on another frame than the first
    ``max_delay`` (the frames :class:`LMStep` marks ungenerated).
    """
    for name in ("encode", "lm", "decode"):
        install_state(getattr(steps, name), state[name])
    frames = []
    with upstream_eager(steps.lm.up, cuda_graph=cuda_graph), torch.no_grad():
        for k, x in enumerate(pcm):
            frame = stock_frame(steps, x, k)
            if on_frame is not None:
                on_frame(k, frame)
            frames.append(Frame(frame.tokens.clone(), None if frame.pcm is None else frame.pcm.clone()))
    return frames


def stock_frame(steps: StreamSteps, pcm: torch.Tensor, k: int) -> Frame:
    """Frame ``k`` of a stream the stock way, on the upstream modules' own state (inside
    ``upstream_eager`` and ``no_grad``, as :func:`stock_stream` calls it). The frame's tensors are the
    modules' outputs (with the vendor's graphs, Mimi's decode is a graph's static output: clone to keep it).

    Raises ``RuntimeError`` if ``LMGen.step`` returns ``None`` on another frame than the first ``max_delay``.
    """
    mimi, gen = steps.decode.module, steps.lm.gen
    codes = mimi.encode(pcm)
    out = gen.step(codes)
    if (out is None) != (k < steps.max_delay):
        raise RuntimeError(f"frame {k}: LMGen.step returned {'None' if out is None else 'tokens'}, expected "
                           f"tokens from frame {steps.max_delay} on")
    tokens = steps.lm.as_tokens(out, codes.shape[0], codes.device)
    return Frame(tokens, mimi.decode(tokens[:, 1:]) if out is not None else None)


Call = Callable[..., Sequence[torch.Tensor]]


def step_frame(steps: StreamSteps, programs: Mapping[str, Call], state: dict[str, dict[str, torch.Tensor]],
               pcm: torch.Tensor, k: int) -> Frame:
    """Frame ``k`` of a stream through ``programs["encode" | "lm" | "decode"]``, each called with the
    step's convention ``(x, *state) -> (y, *state')``. ``state`` (by step name, then input name) is
    read and replaced by the state each program returns, as it is (fed back uncopied next frame).
    The frame's tensors are the programs' own outputs (clone them to keep them)."""

    def call(name: str, x: torch.Tensor) -> torch.Tensor:
        step: MoshiStep = getattr(steps, name)
        out = programs[name](*step.next_args({"x": x}, state[name]))
        state[name] = step.carry(out)
        return out[0]

    codes = call("encode", pcm)
    tokens = call("lm", codes)
    return Frame(tokens, call("decode", tokens[:, 1:]) if k >= steps.max_delay else None)


def step_stream(steps: StreamSteps, programs: Mapping[str, Call], state: Mapping[str, Mapping[str, torch.Tensor]],
                pcm: Sequence[torch.Tensor], *, on_frame: Callable[[int, Frame], None] | None = None) -> list[Frame]:
    """The stream of :func:`stock_stream` through ``programs`` (:func:`step_frame` per frame), from
    ``state`` (each step's initial state, by step name). Non-region inputs must be on the device;
    region inputs may be anywhere a program accepts them (an optimized program copies them in)."""
    st = {name: dict(s) for name, s in state.items()}
    frames = []
    with torch.no_grad():
        for k, x in enumerate(pcm):
            frame = step_frame(steps, programs, st, x, k)
            if on_frame is not None:
                on_frame(k, frame)
            frames.append(Frame(frame.tokens.clone(), None if frame.pcm is None else frame.pcm.clone()))
    return frames


def shared_replay(device: torch.device | str, *, branches: int = 1) -> Any:
    """The ``replay=`` to optimize the three steps with: one CUDA graph backend for all of them.

    The steps of a frame run one after the other on one stream, so their captures can share one
    stream, and with it one cuBLAS workspace. Each backend otherwise keeps a workspace of its own,
    which moshi's own graphs, all on torch's default capture stream, do not pay.
    Their replays are serialized by the backend (``CudaGraphBackend.exclusive``), so calls from several
    threads stay exact but do not overlap. Concurrent conversations that should run in parallel go
    through lanes (each lane forks a backend of its own). ``branches`` > 1: independent chains of each
    graph on that many parallel streams (:mod:`cadence_fx.analysis.branch_plan`). Off CUDA: ``"auto"`` (no replay)."""
    if torch.device(device).type != "cuda":
        return "auto"
    return CudaGraphBackend(torch.device(device).index, branches=branches)


def user_audio(frames: int, *, batch_size: int = 1, frame_size: int = 1920, seed: int = 0,
               device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``frames`` frames of the user's audio: seeded noise, 0.1 * N(0, 1) (made on the host, then moved)."""
    g = torch.Generator().manual_seed(seed)
    return [(0.1 * torch.randn(batch_size, 1, frame_size, generator=g)).to(device) for _ in range(frames)]


def build_steps(up: Any, cfg: Any, device: torch.device | str = "cpu") -> StreamSteps:
    """The three steps over freshly built modules (seeded random weights) at ``cfg``, streaming batch
    ``cfg.batch_size`` on ``device``."""
    gen = build_lm_gen(up, cfg, build_lm(up, cfg, device))
    mimi = build_mimi(up, cfg, device)
    return StreamSteps(encode=MimiEncodeStep(mimi, up, batch_size=cfg.batch_size),
                       lm=LMStep(gen, up, batch_size=cfg.batch_size),
                       decode=MimiDecodeStep(mimi, up, batch_size=cfg.batch_size))
