"""The exported steps: the full Token2Wav streaming call, and the DiT-only and encoder-only steps."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn

from cadence_fx.adapters.streaming import StreamingStep
from cadence_fx.adapters.token2wav.config import ESTIMATOR_PATH, Driver, Granularity, Token2WavConfig
from cadence_fx.adapters.token2wav.driver import hift_stream, speech_window, trim_conformer_cache, trim_estimator_cache
from cadence_fx.adapters.token2wav.routing import EncoderChunk, EstimatorChunk, VocoderCall, routed, upstream_module
from cadence_fx.adapters.stepaudio2 import unwrap_compiled
from cadence_fx.contract import Contract

__all__ = ["DiTStep", "EncoderStep", "Token2WavStep", "example_prompt"]


class DiTStep(StreamingStep):
    """One estimator call with the driver's trim of its attention cache (CFG batch 2).

    ``(x, mu, t, spks, cond, cnn_cache, att_cache) -> (dphi_dt, cnn_cache', att_cache')``;
    ``att_cache`` is ``(depth, 2, heads, T, 2 * head_dim)``, the DiT concatenates new-then-old.
    """

    inputs = ("x", "mu", "t", "spks", "cond", "cnn_cache", "att_cache")
    state = {"cnn_cache": 1, "att_cache": 2}

    def __init__(self, dit: nn.Module, cfg: Token2WavConfig) -> None:
        super().__init__()
        self.estimator = EstimatorChunk(upstream_module(dit))
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
        self.encoder = EncoderChunk(upstream_module(encoder))
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


_FLOW_STATE = ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att")


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
    :func:`cadence_fx.adapters.token2wav.bounded_vocoder_stream`).

    :meth:`forward` (what is exported) and :meth:`stock_call` (the stock driver, eagerly) run the
    same flow (:meth:`_flow_and_vocoder`); they differ only in how the upstream entry points are
    entered.
    """

    def __init__(self, flow: nn.Module, vocoder: nn.Module | None, cfg: Token2WavConfig, *,
                 driver: Driver = "0.1.2", n_timesteps: int | None = None, float16: bool = False) -> None:
        super().__init__()
        if driver not in ("0.1.2", "1.0.7"):
            raise ValueError(f"driver must be '0.1.2' or '1.0.7', got {driver!r}")
        if float16 and any(p.dtype != torch.float16 for p in flow.parameters()):
            raise ValueError("Token2WavStep(float16=True) needs the flow in half (Token2wav(float16=True) calls "
                             "flow.half()): pass flow.half()")
        self.flow = flow
        self.float16 = float16
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

    def _flow_and_vocoder(self, kw: Mapping[str, torch.Tensor | None], inference_chunk: Callable[..., Any],
                          hift: Callable[[torch.Tensor, torch.Tensor], Any] | None) -> tuple[torch.Tensor, ...]:
        """One ``Token2wav.stream`` call: ``inference_chunk`` (encoder + CFM loop), the driver's trims of
        both attention caches, then (``hift`` given) the 0.1.2 HiFT streaming. ``kw`` holds the step's
        inputs by name; outputs are in the step's order."""
        cfg = self.cfg
        cache = {"conformer_cnn_cache": kw["conformer_cnn"], "conformer_att_cache": kw["conformer_att"],
                 "estimator_cnn_cache": kw["estimator_cnn"], "estimator_att_cache": kw["estimator_att"]}
        with self._autocast(kw["spk"]):
            chunk_mel, cache = inference_chunk(token=kw["token"], spk=kw["spk"], cache=cache, last_chunk=False,
                                               n_timesteps=self.n_timesteps)
        # the driver replaces its cache dict here (``self.stream_cache = ...``): the old caches are gone
        # before the trims allocate, and an eager caller that handed its state over (driver_stream)
        # holds no second copy through them
        for name in _FLOW_STATE:
            kw[name] = None
        est = trim_estimator_cache(cache["estimator_att_cache"], cfg.prompt_frames, cfg.history_frames)
        conf = trim_conformer_cache(cache["conformer_att_cache"], cfg.prompt_frames, cfg.history_frames,
                                    driver=self.driver, depth=len(upstream_module(self.flow.encoder).encoders))
        flow_state = (cache["conformer_cnn_cache"], conf, cache["estimator_cnn_cache"], est)
        if hift is None:
            return (chunk_mel, *flow_state)
        speech, mel_c, src_c, sp_c = hift_stream(hift, chunk_mel, kw["mel_cache"], kw["source_cache"],
                                                 kw["speech_cache"], self.speech_window, cfg)
        return (speech, chunk_mel, *flow_state, mel_c, src_c, sp_c)

    def _autocast(self, like: torch.Tensor) -> contextlib.AbstractContextManager:
        """The driver's ``autocast(float16, enabled=float16)`` around the flow calls (``Token2wav.stream``
        and, in 1.0.7, ``set_stream_cache``), on the device the step runs on: only the flow is in half,
        the vocoder runs in float32 outside it. Off, nothing is entered (0.1.2 enters a float32
        autocast, which CUDA disables: same ops)."""
        if not self.float16:
            return contextlib.nullcontext()
        return torch.amp.autocast(like.device.type, dtype=torch.float16)

    def forward(self, token: torch.Tensor, spk: torch.Tensor, conformer_cnn: torch.Tensor,
                conformer_att: torch.Tensor, estimator_cnn: torch.Tensor, estimator_att: torch.Tensor,
                mel_cache: torch.Tensor | None = None, source_cache: torch.Tensor | None = None,
                speech_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        kw = dict(token=token, spk=spk, conformer_cnn=conformer_cnn, conformer_att=conformer_att,
                  estimator_cnn=estimator_cnn, estimator_att=estimator_att, mel_cache=mel_cache,
                  source_cache=source_cache, speech_cache=speech_cache)
        # the function under @torch.inference_mode(), so export traces plain tensors; the vocoder
        # through its proxy, so export records the call
        inference_chunk = functools.partial(unwrap_compiled(type(self.flow).inference_chunk), self.flow)
        return self._flow_and_vocoder(kw, inference_chunk, self.vocoder)

    def stock_call(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One call the way ``Token2wav.stream`` makes it, eagerly: the decorated upstream entry points
        (``flow.inference_chunk`` under inference mode, the 1.0.7 encoder through ``torch.compile``),
        then the trims and the vocoder. Outputs are in the step's order."""
        kw = dict(zip(self.inputs, args))
        hift = self.vocoder.upstream if self.vocoder is not None else None
        with torch.inference_mode():
            outs = self._flow_and_vocoder(kw, self.flow.inference_chunk, hift)
        return tuple(t.clone() for t in outs)  # outside inference mode: plain tensors

    def driver_call(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One call with the stock driver's own state handling (``Token2wav.stream``): the decorated
        ``flow.inference_chunk`` (its own inference mode), the trims, HiFT, and copies only of the
        vocoder caches, which the driver stores as ``x[..., -n:].clone().detach()``. No other copy:
        the flow state is what ``inference_chunk`` returns, as the driver keeps it. :meth:`stock_call`
        clones every output. The caller's ``args`` keep the previous state alive through the call;
        :meth:`driver_stream` does not."""
        return self._driver(dict(zip(self.inputs, args)))

    def driver_stream(self, fresh: Mapping[str, torch.Tensor], state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """:meth:`driver_call` taking the state over, as the driver owns ``self.stream_cache``: ``state``
        is emptied on entry, and the flow caches it held are released once ``inference_chunk`` returns
        (the driver's reassignment), so no previous state lives through the trims. The baseline for
        memory: its peak is the stock driver's."""
        kw = {**fresh, **state}
        state.clear()
        return self._driver(kw)

    def _driver(self, kw: dict[str, torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        hift = self.vocoder.upstream if self.vocoder is not None else None
        outs = self._flow_and_vocoder(kw, self.flow.inference_chunk, hift)
        if hift is None:
            return outs
        *head, mel_c, src_c, sp_c = outs
        return (*head, mel_c.clone().detach(), src_c.clone().detach(), sp_c.clone().detach())

    def export_context(self, contract: Contract,
                       granularity: Granularity | None = None) -> contextlib.AbstractContextManager:
        """The flow's proxies (:func:`routed`) for the export: the estimator's routing (``"step"``)
        whenever ``contract`` wraps or splits at the estimator, since only that routing makes its
        calls visible (it installs the CFM-loop proxy too, so both clocks export); else
        ``granularity`` (default ``"chunk"``)."""
        if ESTIMATOR_PATH in contract.wrap + contract.split_at:
            granularity = "step"
        return routed(self.flow, granularity=granularity or "chunk")

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
        with torch.inference_mode(), self._autocast(spk):
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
        encoder, cfm = upstream_module(self.flow.encoder), upstream_module(self.flow.decoder)
        dev = cfm.att_cache_buffer.device
        flow = dict(device=dev, dtype=cfm.att_cache_buffer.dtype)  # half under the float16 switch
        d_k = cfg.output_size // cfg.attention_heads
        att = list(cfm.att_cache_buffer.shape)
        att[4] = t
        state = {"conformer_cnn": torch.zeros(1, cfg.output_size, cfg.conv_cache_frames, **flow),
                 "conformer_att": torch.zeros(len(encoder.encoders) + len(encoder.up_encoders), 1,
                                              cfg.attention_heads, t, 2 * d_k, **flow),
                 "estimator_cnn": torch.zeros_like(cfm.cnn_cache_buffer),
                 "estimator_att": torch.zeros(att, **flow)}
        if self.vocoder is not None:
            state.update(mel_cache=torch.zeros(1, cfg.mel_channels, 0, device=dev),
                         source_cache=torch.zeros(1, 1, 0, device=dev), speech_cache=torch.zeros(1, 0, device=dev))
        return state

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
