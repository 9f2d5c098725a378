"""The Token2Wav adapter: the stock Step-Audio2 / MiniCPM-o streaming decoder as cadence_fx steps.

What one streaming call of the stock driver (``Token2wav.stream`` in ``stepaudio2/token2wav.py``)
does, and what the exported step reproduces:

1. ``flow.inference_chunk``: the upsampling conformer encoder (``forward_chunk``) on 25 + 3
   lookahead tokens, then the 10-step Euler CFM loop, each step one call of the DiT estimator
   with CFG batch 2;
2. the driver's trim of both attention caches to ``[:prompt] + [-100:]`` frames (0.1.2 trims
   the packed conformer cache as one tensor; 1.0.7 trims its token-rate and mel-rate halves
   separately and repacks them);
3. 0.1.2: HiFT vocoding with the driver's 8-frame mel cache, 3840-sample source cache and
   the Hamming cross-fade with the previous chunk's speech tail. 1.0.7 streams through a
   ``BoundedVocoder`` whose state is host-side integer bookkeeping; it is not exportable to a
   finite catalog and runs after the step (:func:`bounded_vocoder_stream`), its stateless
   ``decode`` optionally as a replayed catalog
   (:func:`cadence_fx.adapters.bounded_vocoder.replay_bounded_vocoder`).

Everything model-side is the upstream code, imported (:mod:`cadence_fx.adapters.upstream`);
what lives here is the driver logic of ``token2wav.py`` (a module that cannot be imported
without onnxruntime, torchaudio and the ASR tokenizer), the wrappers that make the wrapped
callables visible to ``torch.export`` and the contract.

Why wrappers: a module entered through a method other than ``__call__`` (upstream calls
``self.encoder.forward_chunk(...)``, ``self.decoder.forward_chunk(...)``,
``self.estimator.forward_chunk(...)``) is not recorded in ``nn_module_stack``, so cadence_fx
could not find its boundary. :func:`routed` installs small proxies whose ``forward_chunk``
goes through ``__call__``, for the duration of an export, and puts the user's modules back
afterwards (their ``state_dict`` keys never change). The proxies must be in the module tree
when ``torch.export`` starts: it records calls on the attribute path it reached a module by,
so swapping a proxy in from inside ``forward`` is not seen.
"""

from __future__ import annotations

import contextlib
import math
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.export import ExportedProgram

from cadence_fx.adapters.upstream import unwrap_compiled
from cadence_fx.contract import Clock, Contract, HeadTail, Region, Ring, SlidingWindow
from cadence_fx.plan import call_classes

Driver = Literal["0.1.2", "1.0.7"]
Granularity = Literal["chunk", "step"]

# Paths of the wrapped callables in the exported step (see :func:`routed`).
ENCODER_PATH = "flow.encoder"
CFM_PATH = "flow.decoder"
ESTIMATOR_PATH = "flow.decoder.upstream.estimator"
VOCODER_PATH = "vocoder"


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class Token2WavConfig:
    """Dimensions and stream schedule. The defaults are the released model and the stock driver.

    The DiT and the CFM workspaces hard-code 16 layers x 8 heads x 128 (k and v of head size 64)
    and 1024 conv channels, so the estimator keeps its released width in every configuration;
    :meth:`reduced` shrinks the encoder and the vocoder, the stream lengths and the solver steps.
    """

    # UpsampleConformerEncoderV2
    input_size: int = 512
    output_size: int = 512
    pre_lookahead_len: int = 3
    num_blocks: int = 6
    num_up_blocks: int = 4
    up_stride: int = 2
    attention_heads: int = 8
    linear_units: int = 2048
    # DiT estimator (in_channels = x, mu, spks, cond: 4 x mel_channels)
    mel_channels: int = 80
    dit_depth: int = 16
    dit_heads: int = 8
    dit_head_dim: int = 64
    dit_hidden: int = 512
    # CausalConditionalCFM
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10
    # flow
    vocab_size: int = 6561
    spk_embed_dim: int = 192
    # HiFTGenerator (hop 480 samples per mel frame at 24 kHz with the default upsampling)
    hift_base_channels: int = 512
    # stream schedule of the stock driver
    prompt_tokens: int = 151
    lookahead_pad_token: int = 4218
    chunk_tokens: int = 25
    history_frames: int = 100  # the driver keeps [:prompt] + [-100:] frames
    mel_cache_frames: int = 8  # HiFT driver: 8-frame mel cache (160 ms)
    hop_samples: int = 480
    # frames the stock workspaces reserve (CFM (16,16,2,8,1000,128), DiT (16,2,8,1000,128));
    # None keeps the stock 1000. Only the capacity changes, never a computed value.
    workspace_frames: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.history_frames % self.up_stride:
            # the packed conformer cache keeps token-rate halves: the kept history must split evenly
            raise ValueError(f"Token2WavConfig.history_frames ({self.history_frames}) must be a multiple of "
                             f"up_stride ({self.up_stride})")
        need = self.prompt_frames + self.history_frames + self.chunk_frames
        if self.workspace_frames is not None and self.workspace_frames < need:
            raise ValueError(f"Token2WavConfig.workspace_frames ({self.workspace_frames}) is smaller than the longest "
                             f"history the stream writes (prompt + history + chunk = {need} frames)")
        if self.output_size % self.attention_heads:
            raise ValueError("Token2WavConfig.output_size must be divisible by attention_heads")

    @property
    def up_rate(self) -> int:
        return self.up_stride

    @property
    def prompt_frames(self) -> int:
        """Mel frames of the prompt (302 for 151 tokens)."""
        return self.prompt_tokens * self.up_rate

    @property
    def chunk_frames(self) -> int:
        """Mel frames one call adds (50 for 25 tokens)."""
        return self.chunk_tokens * self.up_rate

    @property
    def call_tokens(self) -> int:
        """Tokens per streaming call: new tokens plus the lookahead (28)."""
        return self.chunk_tokens + self.pre_lookahead_len

    @property
    def source_cache_samples(self) -> int:
        """Samples of source and speech history the HiFT driver keeps (3840)."""
        return self.mel_cache_frames * self.hop_samples

    @property
    def conv_cache_frames(self) -> int:
        """Packed conformer conv cache: 2 (pre-lookahead conv) + 2 x stride (upsampler)."""
        return 2 + 2 * self.up_stride

    @property
    def retention(self) -> HeadTail:
        return HeadTail(self.prompt_frames, self.history_frames)

    @classmethod
    def reduced(cls, **overrides: Any) -> "Token2WavConfig":
        """A configuration for CPU tests: small encoder and vocoder, short stream, 2 solver steps.

        The DiT keeps depth 16 at hidden 512 (the CFM workspace requires it); the prompt is 8
        tokens (16 frames), chunks are 5 + 3 tokens (10 frames) and the history is 20 frames, so
        the attention histories visit 16, 26, 36 frames and the trim fires from the third call.
        """
        base = dict(input_size=64, output_size=64, num_blocks=2, num_up_blocks=2, attention_heads=4,
                    linear_units=128, n_timesteps=2, hift_base_channels=64, prompt_tokens=8, chunk_tokens=5,
                    history_frames=20, workspace_frames=64)
        base.update(overrides)
        return cls(**base)


# --------------------------------------------------------------------------- building
def build_encoder(up: types.SimpleNamespace, cfg: Token2WavConfig) -> nn.Module:
    """``UpsampleConformerEncoderV2`` with random (seeded) weights, in eval mode."""
    torch.manual_seed(cfg.seed)
    return up.UpsampleConformerEncoderV2(
        input_size=cfg.input_size, output_size=cfg.output_size, pre_lookahead_len=cfg.pre_lookahead_len,
        num_blocks=cfg.num_blocks, num_up_blocks=cfg.num_up_blocks, up_stride=cfg.up_stride,
        attention_heads=cfg.attention_heads, linear_units=cfg.linear_units).eval()


def build_dit(up: types.SimpleNamespace, cfg: Token2WavConfig, *, randomize: bool = True) -> nn.Module:
    """The DiT estimator with random (seeded) weights, in eval mode.

    Upstream zero-initialises the adaLN and output layers (a freshly initialised DiT outputs
    zeros and ignores its caches); ``randomize`` gives every parameter seeded random values so
    the streams carry information through every layer.
    """
    torch.manual_seed(cfg.seed + 1)
    dit = up.DiT(in_channels=4 * cfg.mel_channels, out_channels=cfg.mel_channels, depth=cfg.dit_depth,
                 num_heads=cfg.dit_heads, head_dim=cfg.dit_head_dim, hidden_size=cfg.dit_hidden)
    if randomize:
        _randomize(dit, cfg.seed + 2)
    _resize_workspace(dit, "att_cache_buffer", cfg.workspace_frames, axis=3)
    return dit.eval()


def build_flow(up: types.SimpleNamespace, cfg: Token2WavConfig) -> nn.Module:
    """``CausalMaskedDiffWithXvec`` (encoder + ``CausalConditionalCFM`` over the DiT), random weights, eval."""
    encoder = build_encoder(up, cfg)
    dit = build_dit(up, cfg)
    torch.manual_seed(cfg.seed + 3)  # the CFM's rand_noise buffer
    cfm = up.CausalConditionalCFM(dit, inference_cfg_rate=cfg.inference_cfg_rate)
    _resize_workspace(cfm, "att_cache_buffer", cfg.workspace_frames, axis=4)
    torch.manual_seed(cfg.seed + 4)
    flow = up.CausalMaskedDiffWithXvec(input_size=cfg.input_size, output_size=cfg.mel_channels,
                                       spk_embed_dim=cfg.spk_embed_dim, vocab_size=cfg.vocab_size,
                                       encoder=encoder, decoder=cfm)
    return flow.eval()


def build_vocoder(up: types.SimpleNamespace, cfg: Token2WavConfig) -> nn.Module:
    """``HiFTGenerator`` (``flashcosyvoice.modules.hifigan``, defaults but ``base_channels``), random weights, eval."""
    torch.manual_seed(cfg.seed + 5)
    return up.HiFTGenerator(base_channels=cfg.hift_base_channels).eval()


def _randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() > 1:  # weights: unit-variance outputs for unit-variance inputs
                p.copy_(noise / math.sqrt(p[0].numel()))
            elif name.endswith("weight"):  # norm scales around one
                p.copy_(1.0 + 0.1 * noise)
            else:  # biases
                p.copy_(0.1 * noise)


def _resize_workspace(module: nn.Module, name: str, frames: int | None, axis: int) -> None:
    if frames is None:
        return
    old = getattr(module, name)
    shape = list(old.shape)
    shape[axis] = frames
    module.register_buffer(name, torch.zeros(shape, dtype=old.dtype, device=old.device), persistent=False)


# --------------------------------------------------------------------------- wrappers
class _Route(nn.Module):
    """Base of the proxies: ``forward_chunk`` enters through ``__call__`` so export records the call."""

    def __init__(self, upstream: nn.Module) -> None:
        super().__init__()
        self.upstream = upstream

    def forward_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)


class EncoderChunk(_Route):
    """``UpsampleConformerEncoderV2.forward_chunk`` as a module call.

    1.0.7 decorates ``forward_chunk`` with ``torch.compile(dynamic=True, backend="eager")``;
    this calls the function the decorator wraps (what 0.1.2 runs undecorated), so export traces
    the upstream code itself instead of a Dynamo frame.
    """

    def forward(self, xs: torch.Tensor, last_chunk: bool = False, cnn_cache: torch.Tensor | None = None,
                att_cache: torch.Tensor | None = None):
        fn = unwrap_compiled(type(self.upstream).forward_chunk)
        return fn(self.upstream, xs, last_chunk, cnn_cache, att_cache)


class CFMChunk(_Route):
    """``CausalConditionalCFM.forward_chunk`` (the whole Euler loop) as a module call: the chunk clock.

    Calls the function under ``@torch.inference_mode()`` directly: export traces plain tensors.
    """

    def forward(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, n_timesteps: int = 10,
                temperature: float = 1.0, cnn_cache: torch.Tensor | None = None,
                att_cache: torch.Tensor | None = None):
        fn = unwrap_compiled(type(self.upstream).forward_chunk)
        return fn(self.upstream, mu, spks, cond, n_timesteps, temperature, cnn_cache, att_cache)


class EstimatorChunk(_Route):
    """``DiT.forward_chunk`` as a module call: installed as ``cfm.estimator``, each solver step is
    its own invocation (the step clock)."""

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                cnn_cache: torch.Tensor | None = None, att_cache: torch.Tensor | None = None):
        return self.upstream.forward_chunk(x, mu, t, spks, cond, cnn_cache, att_cache)


class VocoderCall(_Route):
    """``HiFTGenerator.forward(mel, cache_source)`` (the function under ``@torch.inference_mode()``)."""

    def forward(self, speech_feat: torch.Tensor, cache_source: torch.Tensor):
        fn = unwrap_compiled(type(self.upstream).forward)
        return fn(self.upstream, speech_feat, cache_source)


@contextlib.contextmanager
def routed(flow: nn.Module, *, granularity: Granularity = "chunk") -> Iterator[None]:
    """Install the proxies on ``flow`` (encoder, decoder and, for ``"step"``, the estimator); restore on exit.

    The exported program keeps the proxies' paths (:data:`ENCODER_PATH`, :data:`CFM_PATH`,
    :data:`ESTIMATOR_PATH`); the user's modules are unchanged after the block. A program exported
    with ``"step"`` routing carries both the CFM-loop and the per-step boundaries, so it serves
    both granularities: the contract's ``wrap`` list picks one.
    """
    cfm = flow.decoder
    saved = [(flow, "encoder", flow.encoder), (flow, "decoder", cfm), (cfm, "estimator", cfm.estimator)]
    if isinstance(flow.encoder, _Route) or isinstance(cfm, _Route):
        raise RuntimeError("routed(): the flow already has cadence_fx proxies installed")
    try:
        if granularity == "step":
            cfm._modules["estimator"] = EstimatorChunk(cfm.estimator)
        elif granularity != "chunk":
            raise ValueError(f"granularity must be 'chunk' or 'step', got {granularity!r}")
        flow._modules["encoder"] = EncoderChunk(flow.encoder)
        flow._modules["decoder"] = CFMChunk(cfm)
        yield
    finally:
        for owner, name, mod in saved:
            owner._modules[name] = mod


def _upstream(m: nn.Module) -> nn.Module:
    return m.upstream if isinstance(m, _Route) else m


# --------------------------------------------------------------------------- driver logic
# The per-chunk work of ``Token2wav.stream`` (stepaudio2/token2wav.py), which cannot be imported
# here (its module imports onnxruntime, torchaudio and s3tokenizer at the top).

def trim_estimator_cache(att: torch.Tensor, prompt_frames: int, history_frames: int = 100) -> torch.Tensor:
    """The driver's estimator trim (both releases): ``cat([att[..., :prompt, :], att[..., -100:, :]], 4)``."""
    if att.shape[4] > prompt_frames + history_frames:
        att = torch.cat([att[:, :, :, :, :prompt_frames], att[:, :, :, :, -history_frames:]], dim=4)
    return att


def trim_conformer_cache(att: torch.Tensor, prompt_frames: int, history_frames: int = 100, *,
                         driver: Driver = "0.1.2", depth: int | None = None) -> torch.Tensor:
    """The driver's conformer trim.

    0.1.2 (bug fix 20260107) trims the packed cache ``(blocks + up_blocks, 1, heads, T, 2 d_k)`` as
    one tensor: ``cat([att[:, :, :, :prompt], att[:, :, :, -100:]], 3)``. 1.0.7 trims the token-rate
    blocks (packed as ``[cache, cache]``) at half the frames and the mel-rate blocks at full frames,
    then repacks ``cat([token.repeat(1, 1, 1, 2, 1), mel], 0)``; ``depth`` is the number of
    token-rate blocks (``len(encoder.encoders)``).
    """
    if att.shape[3] <= prompt_frames + history_frames:
        return att
    if driver == "0.1.2":
        return torch.cat([att[:, :, :, :prompt_frames, :], att[:, :, :, -history_frames:, :]], dim=3)
    if driver != "1.0.7":
        raise ValueError(f"unknown driver {driver!r}")
    if depth is None:
        raise ValueError("trim_conformer_cache(driver='1.0.7') needs depth (number of token-rate blocks)")
    token_cache = att[:depth, :, :, :att.shape[3] // 2]
    token_cache = torch.cat([token_cache[:, :, :, :prompt_frames // 2],
                             token_cache[:, :, :, token_cache.shape[3] - history_frames // 2:]], dim=3)
    mel_cache = torch.cat([att[depth:, :, :, :prompt_frames], att[depth:, :, :, att.shape[3] - history_frames:]],
                          dim=3)
    return torch.cat([token_cache.repeat(1, 1, 1, 2, 1), mel_cache], dim=0)


def speech_window(cfg: Token2WavConfig) -> torch.Tensor:
    """The driver's cross-fade window: ``torch.from_numpy(np.hamming(2 * 3840))`` (float64, as stock)."""
    return torch.from_numpy(np.hamming(2 * cfg.source_cache_samples))


def fade_in_out(fade_in: torch.Tensor, fade_out: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """``token2wav.fade_in_out`` of 0.1.2: the float64 window promotes the blend, stored back as float32."""
    overlap = int(window.shape[0] / 2)
    fade_in = fade_in.clone()
    fade_in[..., :overlap] = fade_in[..., :overlap] * window[:overlap] + fade_out[..., -overlap:] * window[overlap:]
    return fade_in


def hift_stream(hift_call: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                chunk_mel: torch.Tensor, mel_cache: torch.Tensor, source_cache: torch.Tensor,
                speech_cache: torch.Tensor, window: torch.Tensor, cfg: Token2WavConfig, *, last_chunk: bool = False):
    """The 0.1.2 driver's vocoder part of ``stream()``: returns ``(speech, mel', source', speech')``.

    The stock driver stores ``x[..., -n:].clone().detach()`` in its cache dict (so the dict does
    not pin the big tensors); a step's outputs are fresh tensors already, so the slices are
    returned as they are (same values).
    """
    mel = torch.cat([mel_cache, chunk_mel], dim=2)
    speech, source = hift_call(mel, source_cache)
    if speech_cache.shape[-1] > 0:
        speech = fade_in_out(speech, speech_cache, window)
    first = speech_cache.shape[-1] == 0
    n = cfg.source_cache_samples
    new_mel = mel[..., -cfg.mel_cache_frames:]
    new_source = source[:, :, -n:]
    new_speech = speech[:, -n:]
    if not last_chunk:
        if first:
            silence = torch.zeros(1, n, device=speech.device)
            speech = torch.cat([silence, speech[:, :-n]], dim=1)
        else:
            speech = speech[:, :-n]
    return speech, new_mel, new_source, new_speech


# --------------------------------------------------------------------------- steps
class StreamingStep(nn.Module):
    """A step whose state inputs are fed from its own outputs: ``inputs`` names the user inputs in
    order, ``state`` maps each state input to the output index that carries it to the next call."""

    inputs: tuple[str, ...] = ()
    state: Mapping[str, int] = {}

    def next_args(self, fresh: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> tuple:
        """Arguments for one call from the per-call inputs ``fresh`` and the carried ``state``."""
        merged = {**fresh, **state}
        return tuple(merged[n] for n in self.inputs)

    def carry(self, outputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state for the next call, read from this call's outputs."""
        return {name: outputs[i] for name, i in self.state.items()}


class DiTStep(StreamingStep):
    """One estimator call with the driver's trim of its attention cache (CFG batch 2).

    ``(x, mu, t, spks, cond, cnn_cache, att_cache) -> (dphi_dt, cnn_cache', att_cache')``;
    ``att_cache`` is ``(depth, 2, heads, T, 2 * head_dim)``, the DiT concatenates new-then-old.
    """

    inputs = ("x", "mu", "t", "spks", "cond", "cnn_cache", "att_cache")
    state = {"cnn_cache": 1, "att_cache": 2}

    def __init__(self, dit: nn.Module, cfg: Token2WavConfig) -> None:
        super().__init__()
        self.estimator = EstimatorChunk(_upstream(dit))
        self.cfg = cfg

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                cnn_cache: torch.Tensor, att_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, cnn_cache, att_cache = self.estimator(x, mu, t, spks, cond, cnn_cache, att_cache)
        p, r = self.cfg.prompt_frames, self.cfg.history_frames
        if att_cache.shape[3] > p + r:  # the driver's trim, on the DiT's own layout (time on dim 3)
            att_cache = torch.cat([att_cache[:, :, :, :p], att_cache[:, :, :, -r:]], dim=3)
        return y, cnn_cache, att_cache

    def setup(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
              cond: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prompt call (no caches), as ``setup_cache`` runs it: returns the initial state (cloned)."""
        with torch.inference_mode():
            _y, cnn, att = self.estimator.upstream.forward_chunk(x, mu, t, spks, cond, None, None)
        return {"cnn_cache": cnn.clone(), "att_cache": att.clone()}

    def fresh(self, n_calls: int, *, seed: int = 0, frames: int | None = None,
              device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
        """Per-call inputs of a CFG-batch-2 solver step, ``frames`` (default: chunk frames) long."""
        c, n = self.cfg.mel_channels, frames or self.cfg.chunk_frames
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n_calls):
            x = torch.randn(1, c, n, generator=g)
            mu = torch.randn(1, c, n, generator=g)
            spks = torch.randn(1, c, generator=g)
            t = torch.rand(1, generator=g)
            call = {"x": x.repeat(2, 1, 1), "mu": torch.cat([mu, torch.zeros_like(mu)]), "t": t.repeat(2),
                    "spks": torch.cat([spks, torch.zeros_like(spks)]), "cond": torch.zeros(2, c, n)}
            out.append({k: v.to(device) for k, v in call.items()})
        return out


class EncoderStep(StreamingStep):
    """One ``UpsampleConformerEncoderV2.forward_chunk`` call with the driver's conformer trim.

    ``(xs, cnn_cache, att_cache) -> (h, cnn_cache', att_cache')``; ``xs`` are embedded tokens
    ``(1, chunk + lookahead, input_size)``.
    """

    inputs = ("xs", "cnn_cache", "att_cache")
    state = {"cnn_cache": 1, "att_cache": 2}

    def __init__(self, encoder: nn.Module, cfg: Token2WavConfig, *, driver: Driver = "0.1.2") -> None:
        super().__init__()
        self.encoder = EncoderChunk(_upstream(encoder))
        self.cfg = cfg
        self.driver = driver

    def forward(self, xs: torch.Tensor, cnn_cache: torch.Tensor,
                att_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, cnn_cache, att_cache = self.encoder(xs, False, cnn_cache, att_cache)
        att_cache = trim_conformer_cache(att_cache, self.cfg.prompt_frames, self.cfg.history_frames,
                                         driver=self.driver, depth=len(self.encoder.upstream.encoders))
        return h, cnn_cache, att_cache

    def setup(self, xs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prompt call (prompt + lookahead embeddings, no caches): the initial state (cloned)."""
        with torch.inference_mode():
            _h, cnn, att = self.encoder(xs, False, None, None)
        return {"cnn_cache": cnn.clone(), "att_cache": att.clone()}

    def fresh(self, n_calls: int, *, seed: int = 0,
              device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
        """Per-call inputs: random embeddings of 25 + 3 tokens."""
        g = torch.Generator().manual_seed(seed)
        return [{"xs": torch.randn(1, self.cfg.call_tokens, self.cfg.input_size, generator=g).to(device)}
                for _ in range(n_calls)]


class Token2WavStep(StreamingStep):
    """One streaming call of the stock driver: flow chunk, the trims and (0.1.2 driver) HiFT.

    Inputs ``(token, spk, conformer_cnn, conformer_att, estimator_cnn, estimator_att
    [, mel_cache, source_cache, speech_cache])``; outputs ``(speech, mel, conformer_cnn',
    conformer_att', estimator_cnn', estimator_att', mel_cache', source_cache', speech_cache')``
    with a vocoder, ``(mel, conformer_cnn', ..., estimator_att')`` without one. ``token`` is
    ``(1, 28)`` int32, ``spk`` the raw ``(1, 192)`` speaker embedding; ``mel`` is the chunk's 50
    flow frames, ``speech`` the PCM the driver emits for the chunk.

    ``driver`` picks the release whose ``token2wav.py`` is reproduced: "0.1.2" (conformer trimmed
    as one tensor, HiFT with mel/source/speech caches) or "1.0.7" (split conformer trim; its
    streaming vocoder is the host-driven ``BoundedVocoder``, which runs outside the step, see
    :func:`bounded_vocoder_stream`).
    """

    def __init__(self, flow: nn.Module, vocoder: nn.Module | None, cfg: Token2WavConfig, *,
                 driver: Driver = "0.1.2", n_timesteps: int | None = None) -> None:
        super().__init__()
        if driver not in ("0.1.2", "1.0.7"):
            raise ValueError(f"driver must be '0.1.2' or '1.0.7', got {driver!r}")
        self.flow = flow
        self.vocoder = VocoderCall(vocoder) if vocoder is not None else None
        self.cfg = cfg
        self.driver = driver
        self.n_timesteps = cfg.n_timesteps if n_timesteps is None else n_timesteps
        self.register_buffer("speech_window", speech_window(cfg), persistent=False)
        names = ["conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att"]
        if vocoder is not None:
            names += ["mel_cache", "source_cache", "speech_cache"]
        self.inputs = ("token", "spk", *names)
        first = 2 if vocoder is not None else 1
        self.state = {name: first + i for i, name in enumerate(names)}

    def forward(self, token: torch.Tensor, spk: torch.Tensor, conformer_cnn: torch.Tensor,
                conformer_att: torch.Tensor, estimator_cnn: torch.Tensor, estimator_att: torch.Tensor,
                mel_cache: torch.Tensor | None = None, source_cache: torch.Tensor | None = None,
                speech_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        cache = {"conformer_cnn_cache": conformer_cnn, "conformer_att_cache": conformer_att,
                 "estimator_cnn_cache": estimator_cnn, "estimator_att_cache": estimator_att}
        # the function under @torch.inference_mode(): export traces plain tensors
        inference_chunk = unwrap_compiled(type(self.flow).inference_chunk)
        chunk_mel, cache = inference_chunk(self.flow, token=token, spk=spk, cache=cache, last_chunk=False,
                                           n_timesteps=self.n_timesteps)
        cfg = self.cfg
        est = trim_estimator_cache(cache["estimator_att_cache"], cfg.prompt_frames, cfg.history_frames)
        conf = trim_conformer_cache(cache["conformer_att_cache"], cfg.prompt_frames, cfg.history_frames,
                                    driver=self.driver, depth=len(_upstream(self.flow.encoder).encoders))
        flow_state = (cache["conformer_cnn_cache"], conf, cache["estimator_cnn_cache"], est)
        if self.vocoder is None:
            return (chunk_mel, *flow_state)
        speech, mel_c, src_c, sp_c = hift_stream(self.vocoder, chunk_mel, mel_cache, source_cache, speech_cache,
                                                 self.speech_window, cfg)
        return (speech, chunk_mel, *flow_state, mel_c, src_c, sp_c)

    def setup(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
              spk: torch.Tensor) -> dict[str, torch.Tensor]:
        """``set_stream_cache``: ``flow.setup_cache`` on the prompt + 3 lookahead tokens, empty vocoder caches.

        0.1.2 pads the prompt with three silence tokens (id 4218); 1.0.7 repeats its first three
        tokens. Returns the initial state, cloned (``setup_cache`` returns views of the CFM workspace).
        """
        cfg = self.cfg
        if self.driver == "0.1.2":
            pad = torch.full((1, cfg.pre_lookahead_len), cfg.lookahead_pad_token, dtype=prompt_tokens.dtype,
                             device=prompt_tokens.device)
        else:
            pad = prompt_tokens[:, :cfg.pre_lookahead_len]
        with torch.inference_mode():
            cache = self.flow.setup_cache(torch.cat([prompt_tokens, pad], dim=1), prompt_mel, spk,
                                          n_timesteps=self.n_timesteps)
        state = {"conformer_cnn": cache["conformer_cnn_cache"], "conformer_att": cache["conformer_att_cache"],
                 "estimator_cnn": cache["estimator_cnn_cache"], "estimator_att": cache["estimator_att_cache"]}
        if self.vocoder is not None:
            dev = prompt_mel.device
            state.update(mel_cache=torch.zeros(1, prompt_mel.shape[2], 0, device=dev),
                         source_cache=torch.zeros(1, 1, 0, device=dev), speech_cache=torch.zeros(1, 0, device=dev))
        return {k: v.clone() for k, v in state.items()}

    def example_state(self, frames: int | None = None) -> dict[str, torch.Tensor]:
        """Zero tensors shaped like the state after ``setup`` (``frames`` of history, default the
        prompt's): enough to export a step or print its plan without running the prompt."""
        cfg = self.cfg
        t = cfg.prompt_frames if frames is None else frames
        encoder, cfm = _upstream(self.flow.encoder), _upstream(self.flow.decoder)
        dev = cfm.att_cache_buffer.device
        d_k = cfg.output_size // cfg.attention_heads
        att = list(cfm.att_cache_buffer.shape)
        att[4] = t
        state = {"conformer_cnn": torch.zeros(1, cfg.output_size, cfg.conv_cache_frames, device=dev),
                 "conformer_att": torch.zeros(len(encoder.encoders) + len(encoder.up_encoders), 1,
                                              cfg.attention_heads, t, 2 * d_k, device=dev),
                 "estimator_cnn": torch.zeros_like(cfm.cnn_cache_buffer),
                 "estimator_att": torch.zeros(att, device=dev)}
        if self.vocoder is not None:
            state.update(mel_cache=torch.zeros(1, cfg.mel_channels, 0, device=dev),
                         source_cache=torch.zeros(1, 1, 0, device=dev), speech_cache=torch.zeros(1, 0, device=dev))
        return state

    def stock_call(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One call the way ``Token2wav.stream`` makes it, eagerly: the decorated upstream entry points
        (``flow.inference_chunk`` under inference mode, the 1.0.7 encoder through ``torch.compile``),
        then the trims and the vocoder. Outputs are in the step's order."""
        kw = dict(zip(self.inputs, args))
        cache = {"conformer_cnn_cache": kw["conformer_cnn"], "conformer_att_cache": kw["conformer_att"],
                 "estimator_cnn_cache": kw["estimator_cnn"], "estimator_att_cache": kw["estimator_att"]}
        cfg = self.cfg
        with torch.inference_mode():
            chunk_mel, cache = self.flow.inference_chunk(token=kw["token"], spk=kw["spk"], cache=cache,
                                                         last_chunk=False, n_timesteps=self.n_timesteps)
            est = trim_estimator_cache(cache["estimator_att_cache"], cfg.prompt_frames, cfg.history_frames)
            conf = trim_conformer_cache(cache["conformer_att_cache"], cfg.prompt_frames, cfg.history_frames,
                                        driver=self.driver, depth=len(self.flow.encoder.encoders))
            flow_state = (cache["conformer_cnn_cache"], conf, cache["estimator_cnn_cache"], est)
            if self.vocoder is None:
                outs = (chunk_mel, *flow_state)
                return tuple(t.clone() for t in outs)
            hift = self.vocoder.upstream
            speech, mel_c, src_c, sp_c = hift_stream(hift, chunk_mel, kw["mel_cache"], kw["source_cache"],
                                                     kw["speech_cache"], self.speech_window, cfg)
            outs = (speech, chunk_mel, *flow_state, mel_c, src_c, sp_c)
        return tuple(t.clone() for t in outs)  # outside inference mode: plain tensors

    def fresh(self, n_calls: int, spk: torch.Tensor, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
        """Per-call inputs: 28 (25 + 3 lookahead) random int32 tokens (on ``spk``'s device) and ``spk``."""
        g = torch.Generator().manual_seed(seed)
        return [{"token": torch.randint(0, self.cfg.vocab_size, (1, self.cfg.call_tokens), generator=g,
                                        dtype=torch.int64).to(device=spk.device, dtype=torch.int32), "spk": spk}
                for _ in range(n_calls)]


def example_prompt(cfg: Token2WavConfig, *, seed: int = 0,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random stand-ins for what ``_prepare_prompt`` returns from a prompt wav.

    ``(prompt_tokens (1, 151) int32, prompt_mel (1, 302, 80), spk (1, 192))`` at released size.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.prompt_tokens), generator=g).to(torch.int32)
    mel = torch.randn(1, cfg.prompt_frames, cfg.mel_channels, generator=g)
    spk = torch.randn(1, cfg.spk_embed_dim, generator=g)
    return tokens.to(device), mel.to(device), spk.to(device)


# --------------------------------------------------------------------------- contracts
def _clocks(cfg: Token2WavConfig) -> tuple[Clock, ...]:
    return (Clock("token", cfg.chunk_tokens, "speech tokens per call"),
            Clock("frame", cfg.chunk_frames, "mel frames per call"),
            Clock("step", cfg.n_timesteps, "solver steps per call"),
            Clock("sample", cfg.chunk_frames * cfg.hop_samples, "PCM samples per call"))


def token2wav_contract(cfg: Token2WavConfig, granularity: Granularity = "chunk", *, driver: Driver = "0.1.2",
                       vocoder: bool = True, step_segments: bool = True) -> Contract:
    """The native-clock contract of :class:`Token2WavStep`.

    Regions (input names of the step):

    - ``conformer_att``: old-then-new on dim 3, ``HeadTail(prompt, 100)``; 0.1.2 driver only. The
      1.0.7 driver repacks two separately trimmed halves along dim 0, which no single region
      expresses; there the cache passes through unmanaged (a plain input and output).
    - ``estimator_att``: new-then-old (the DiT's order) on dim 4, ``HeadTail(prompt, 100)``; only
      ``n_timesteps`` of the 16 stock step slots are live.
    - ``conformer_cnn`` / ``estimator_cnn``: the causal-conv left contexts. Their fixed extent is
      written as a whole (a packed pair of windows, a per-layer workspace), so they are ``Ring``s.
    - ``vocoder_mel``: the 8-frame mel history, old-then-new, ``SlidingWindow(8)``, empty at first.
    - ``vocoder_source`` / ``vocoder_speech``: 3840-sample histories that the vocoder and the fade
      overwrite rather than concatenate: ``Ring(3840)``, empty before the first chunk.

    Wrapped callables: the encoder, the CFM loop (``"chunk"``: one partition per chunk) or the
    estimator (``"step"``: one partition per solver step), and the vocoder. At the chunk clock,
    ``step_segments`` (default) captures the CFM loop as one graph per solver step
    (``Contract.split_at`` the estimator) while keying and replaying it once per chunk: on the H200
    the single 10,400-node graph of the whole loop ran 104 ms per chunk, the ten step graphs 71 ms
    (``docs/benchmarks.md``). :func:`export_step_catalog` then exports with the estimator visible.
    """
    if granularity not in ("chunk", "step"):
        raise ValueError(f"granularity must be 'chunk' or 'step', got {granularity!r}")
    keep = cfg.retention
    live = {0: cfg.n_timesteps}
    off = 2 if vocoder else 1  # output index of the first state output
    regions = []
    if driver == "0.1.2":
        regions.append(Region("conformer_att", input="conformer_att", output=off + 1, clock="frame", axis=3,
                              order="old_new", retention=keep, initial=cfg.prompt_frames))
    regions += [
        Region("conformer_cnn", input="conformer_cnn", output=off, clock="token", axis=2, order="old_new",
               retention=Ring(cfg.conv_cache_frames), initial=cfg.conv_cache_frames),
        Region("estimator_att", input="estimator_att", output=off + 3, clock="frame", axis=4, order="new_old",
               retention=keep, initial=cfg.prompt_frames, live=live),
        Region("estimator_cnn", input="estimator_cnn", output=off + 2, clock="frame", axis=4, order="old_new",
               retention=Ring(2), initial=2, live=live),
    ]
    if vocoder:
        n = cfg.source_cache_samples
        regions += [
            Region("vocoder_mel", input="mel_cache", output=6, clock="frame", axis=2, order="old_new",
                   retention=SlidingWindow(cfg.mel_cache_frames), initial=0),
            Region("vocoder_source", input="source_cache", output=7, clock="sample", axis=2, order="old_new",
                   retention=Ring(n), initial=0),
            Region("vocoder_speech", input="speech_cache", output=8, clock="sample", axis=1, order="old_new",
                   retention=Ring(n), initial=0),
        ]
    inner = CFM_PATH if granularity == "chunk" else ESTIMATOR_PATH
    wrap = (ENCODER_PATH, inner) + ((VOCODER_PATH,) if vocoder else ())
    split = (ESTIMATOR_PATH,) if step_segments and granularity == "chunk" else ()
    return Contract(clocks=_clocks(cfg), regions=tuple(regions), wrap=wrap, split_at=split)


def dit_step_contract(cfg: Token2WavConfig) -> Contract:
    """The contract of :class:`DiTStep`: the attention cache (new-then-old, dim 3) and the conv cache."""
    return Contract(
        clocks=_clocks(cfg),
        regions=(
            Region("dit_att", input="att_cache", output=2, clock="frame", axis=3, order="new_old",
                   retention=cfg.retention, initial=cfg.prompt_frames),
            Region("dit_cnn", input="cnn_cache", output=1, clock="frame", axis=3, order="old_new",
                   retention=Ring(2), initial=2),
        ),
        wrap=("estimator",))


def encoder_step_contract(cfg: Token2WavConfig) -> Contract:
    """The contract of :class:`EncoderStep` with the 0.1.2 trim (old-then-new on dim 3)."""
    return Contract(
        clocks=_clocks(cfg),
        regions=(
            Region("conformer_att", input="att_cache", output=2, clock="frame", axis=3, order="old_new",
                   retention=cfg.retention, initial=cfg.prompt_frames),
            Region("conformer_cnn", input="cnn_cache", output=1, clock="token", axis=2, order="old_new",
                   retention=Ring(cfg.conv_cache_frames), initial=cfg.conv_cache_frames),
        ),
        wrap=("encoder",))


# --------------------------------------------------------------------------- export and streaming
def signature(args: Sequence[Any]) -> tuple:
    """The static signature an exported program is specialised to: shapes and dtypes of the tensors."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args)


def export_step_catalog(step: StreamingStep, state: Mapping[str, torch.Tensor],
                        fresh: Sequence[Mapping[str, torch.Tensor]], contract: Contract, *,
                        granularity: Granularity = "chunk") -> list[ExportedProgram]:
    """One static-shape ``torch.export`` program per catalog class of ``contract``.

    ``granularity`` picks the flow's routing; the estimator's (``"step"``) is used whenever the
    contract wraps or splits at the estimator, since only that routing makes its calls visible.

    The step runs eagerly from ``state`` (the stock computation, on the step's own modules) for as
    many calls as the catalog has classes; each call whose signature is new is then exported with
    that call's real inputs as example inputs. For a
    :class:`Token2WavStep` the flow's proxies are installed for the export only (:func:`routed`).
    Raises ``ValueError`` when ``fresh`` has fewer calls than the catalog has classes.
    """
    n = len(call_classes(contract))
    if len(fresh) < n:
        raise ValueError(f"export_step_catalog: {n} catalog classes need {n} calls of fresh inputs, got {len(fresh)}")
    if ESTIMATOR_PATH in contract.wrap + contract.split_at:
        granularity = "step"  # the step routing installs the CFM-loop proxy too: both clocks export

    def route() -> contextlib.AbstractContextManager:
        if isinstance(step, Token2WavStep):
            return routed(step.flow, granularity=granularity)
        return contextlib.nullcontext()

    # First walk the catalog eagerly, so every lazily grown table (the conformer's positional
    # encoding) already covers the longest extent before tracing starts; then export each class.
    calls: list[tuple] = []
    seen: set[tuple] = set()
    st = {k: v.clone() for k, v in state.items()}
    for k in range(n):
        args = step.next_args(fresh[k], st)
        if signature(args) not in seen:
            seen.add(signature(args))
            calls.append(tuple(a.clone() for a in args))
        with torch.no_grad():
            outs = step(*args)
        st = {name: t.clone() for name, t in step.carry(outs).items()}
    _normalize_inference_tensors(step)
    eps: list[ExportedProgram] = []
    for args in calls:
        with route():
            eps.append(torch.export.export(step, args))
    return eps


def _normalize_inference_tensors(module: nn.Module) -> None:
    """Replace tensors the upstream code cached under ``torch.inference_mode`` by plain copies.

    ``setup_cache``/``inference_chunk`` run in inference mode, and the conformer's positional
    encoding grows its table lazily there (``extend_pe``) when a stream is longer than its
    initial table: that attribute becomes an inference tensor, which export (tracing with
    autograd on) refuses. Same values, plain tensors; the user's modules keep working as before.
    """
    for mod in module.modules():
        for key, val in list(vars(mod).items()):
            if isinstance(val, torch.Tensor) and not isinstance(val, nn.Parameter) and val.is_inference():
                setattr(mod, key, val.clone())
        for key, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_inference():
                mod._buffers[key] = buf.clone()


class CatalogReference:
    """The unmodified exported programs behind one callable: dispatches on the input signature."""

    def __init__(self, eps: Sequence[ExportedProgram]) -> None:
        self.table = {}
        for ep in eps:
            phs = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
            key = tuple((tuple(phs[name].meta["val"].shape), phs[name].meta["val"].dtype)
                        for name in ep.graph_signature.user_inputs)
            self.table[key] = ep.module()

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = signature(args)
        if key not in self.table:
            raise KeyError(f"no exported program for signature {key}")
        return tuple(self.table[key](*args))


def run_stream(program: Callable[..., Sequence[torch.Tensor]], step: StreamingStep, state: Mapping[str, torch.Tensor],
               fresh: Sequence[Mapping[str, torch.Tensor]], *,
               restore: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
               on_call: Callable[[int, Sequence[torch.Tensor]], None] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Drive ``program`` (the eager step, ``step.stock_call``, a :class:`CatalogReference` or an
    optimized program) through ``len(fresh)`` calls, feeding each call's state outputs back as they are.

    ``restore`` maps a call index to a state snapshot that replaces the carried state before
    that call (a turn-boundary restore: foreign tensors). ``on_call(k, outputs)`` sees the raw
    outputs before they are cloned. Returns every call's outputs, cloned as a consumer reads them.
    """
    st = dict(state)
    outs = []
    for k, f in enumerate(fresh):
        if restore and k in restore:
            st = {name: t.clone() for name, t in restore[k].items()}
        with torch.no_grad():
            raw = program(*step.next_args(f, st))
        if on_call is not None:
            on_call(k, raw)
        outs.append(tuple(t.clone() for t in raw))
        st = step.carry(raw)
    return outs


def run_stock_stream(step: Token2WavStep, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, spk: torch.Tensor,
                     tokens: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """The stock driver end to end, eagerly: ``set_stream_cache`` (``flow.setup_cache``) then one
    ``stream`` call per entry of ``tokens`` (each ``(1, 28)`` int32). Outputs are in the step's order."""
    state = step.setup(prompt_tokens, prompt_mel, spk)
    fresh = [{"token": t, "spk": spk} for t in tokens]
    return run_stream(step.stock_call, step, state, fresh)


def export_plan_step(up: types.SimpleNamespace, cfg: Token2WavConfig | None = None) -> tuple[ExportedProgram, Contract]:
    """The flow step at ``cfg`` (default: released) exported once, for :func:`cadence_fx.plan`, and its contract.

    The plan reads shapes only (the workspaces the program allocates, the region inputs), so the
    step is exported with a single solver step from zero state: a few seconds on a CPU instead
    of the ~24 s of the 10-step loop. The contract carries the configured solver steps.
    """
    cfg = Token2WavConfig() if cfg is None else cfg
    step = Token2WavStep(build_flow(up, cfg), None, cfg, n_timesteps=1).eval()
    _tokens, _mel, spk = example_prompt(cfg)
    args = step.next_args({"token": torch.zeros(1, cfg.call_tokens, dtype=torch.int32), "spk": spk},
                          step.example_state())
    with routed(step.flow, granularity="step"):  # the estimator visible: the contract splits at it
        ep = torch.export.export(step, args)
    return ep, token2wav_contract(cfg, vocoder=False)


def plan_target(root: str | os.PathLike | None = None) -> tuple[ExportedProgram, Contract]:
    """``cadence-fx plan token2wav``: the released flow step of minicpmo 0.1.2 and its contract.

    ``root`` is the folder holding ``minicpmo-0.1.2/`` (default: ``$CADENCE_FX_UPSTREAM``, else
    ``<repo>/.upstream``).
    """
    from cadence_fx.adapters.upstream import load_stepaudio2

    base = Path(root or os.environ.get("CADENCE_FX_UPSTREAM") or Path(__file__).resolve().parents[2] / ".upstream")
    return export_plan_step(load_stepaudio2(base / "minicpmo-0.1.2"))


# --------------------------------------------------------------------------- 1.0.7 vocoder
def build_causal_vocoder(up: types.SimpleNamespace, cfg: Token2WavConfig) -> Any:
    """A 1.0.7 ``BoundedVocoder`` over a ``CausalHiFTGenerator`` with random (seeded) weights.

    The released configuration ships with the weights (``config.yaml``), which are not available
    here; this one satisfies every check of the 1.0.7 driver (24 kHz, 480 samples per frame, the
    causal ``SineGen2`` path, an 8-frame delay: F0 right context 3 + ``conv_pre`` look-right 4 + 1)
    with the HiFT upsampling of the 0.1.2 vocoder. Returns the vocoder reset for a new stream,
    with the driver's ``first_chunk`` flag set (``set_stream_cache``).
    """
    if up.BoundedVocoder is None:
        raise RuntimeError(f"stepaudio2 {up.version} has no causal_vocoder (it arrived in minicpmo-utils 1.0.7)")
    torch.manual_seed(cfg.seed + 6)
    width = cfg.hift_base_channels
    hift = up.causal_generator.CausalHiFTGenerator(
        in_channels=cfg.mel_channels, base_channels=width, sampling_rate=24000, upsample_rates=[8, 5, 3],
        upsample_kernel_sizes=[16, 11, 7], istft_params={"n_fft": 16, "hop_len": 4},
        source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3, 5]] * 3,
        conv_pre_look_right=4,
        f0_predictor=up.causal_f0_predictor.CausalConvRNNF0Predictor(cond_channels=width)).float().eval()
    return new_bounded_stream(up, hift)


def new_bounded_stream(up: types.SimpleNamespace, hift: nn.Module) -> Any:
    """A fresh ``BoundedVocoder`` stream over ``hift`` as ``set_stream_cache`` (1.0.7) starts one."""
    vocoder = up.BoundedVocoder(hift)
    vocoder.reset()
    vocoder.cache["first_chunk"] = torch.ones(1, dtype=torch.long)
    return vocoder


def bounded_vocoder_stream(vocoder: Any, chunk_mel: torch.Tensor, cfg: Token2WavConfig, *,
                           last_chunk: bool = False) -> torch.Tensor:
    """The 1.0.7 driver's ``_stream_vocode`` on a ``BoundedVocoder``: eager, host-driven.

    Not part of any exported step: its state is a dict of integer offsets read with ``.item()``
    that pick slice bounds and absolute positions in a fixed noise table, so each call would be
    a new static program (no finite catalog). It runs after the optimized flow step, exactly as
    in the stock driver, and consumes the step's ``mel`` output. Its neural decoder can still be
    replayed: :func:`cadence_fx.adapters.bounded_vocoder.replay_bounded_vocoder`.
    """
    cache = vocoder.cache
    speech = vocoder.stream(chunk_mel, finalize=last_chunk)
    if not torch.isfinite(speech).all():
        raise RuntimeError("Causal vocoder returned non-finite audio")
    if speech.shape[-1] and bool(cache["first_chunk"].item()):
        cache["first_chunk"].zero_()
        if not last_chunk:
            speech = torch.cat([speech.new_zeros(1, cfg.source_cache_samples), speech], dim=1)
    return speech


__all__ = [
    "bounded_vocoder_stream", "build_causal_vocoder", "build_dit", "build_encoder", "build_flow",
    "build_vocoder", "CatalogReference", "CFM_PATH", "CFMChunk", "dit_step_contract", "DiTStep",
    "ENCODER_PATH", "encoder_step_contract", "EncoderChunk", "EncoderStep", "ESTIMATOR_PATH",
    "EstimatorChunk", "example_prompt", "export_plan_step", "export_step_catalog", "fade_in_out", "hift_stream",
    "new_bounded_stream", "plan_target", "routed", "run_stock_stream", "run_stream", "signature", "speech_window",
    "StreamingStep", "token2wav_contract", "Token2WavConfig", "Token2WavStep", "trim_conformer_cache",
    "trim_estimator_cache", "VOCODER_PATH", "VocoderCall",
]
