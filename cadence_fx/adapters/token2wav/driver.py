"""The stock driver's per-chunk work, reproduced from ``Token2wav.stream`` (``stepaudio2/token2wav.py``).

That module cannot be imported here (it imports onnxruntime, torchaudio and s3tokenizer at the
top), so what it does between the model calls lives here: the cache trims of both releases, the
0.1.2 HiFT streaming (mel/source/speech caches and the Hamming cross-fade), the 1.0.7
``BoundedVocoder`` stream, and the eager end-to-end driver used as the stock baseline.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from cadence_fx.adapters.streaming import run_stream
from cadence_fx.adapters.token2wav.config import Driver, Token2WavConfig

if TYPE_CHECKING:
    from cadence_fx.adapters.token2wav.steps import Token2WavStep

__all__ = ["bounded_vocoder_stream", "fade_in_out", "hift_stream", "new_bounded_stream", "run_stock_stream",
           "speech_window", "trim_conformer_cache", "trim_estimator_cache"]


# --------------------------------------------------------------------------- trims
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


# --------------------------------------------------------------------------- 0.1.2: HiFT streaming
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


# --------------------------------------------------------------------------- 1.0.7: BoundedVocoder
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


# --------------------------------------------------------------------------- end to end
def run_stock_stream(step: "Token2WavStep", prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                     spk: torch.Tensor, tokens: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """The stock driver end to end, eagerly: ``set_stream_cache`` (``flow.setup_cache``) then one
    ``stream`` call per entry of ``tokens`` (each ``(1, 28)`` int32). Outputs are in the step's order."""
    state = step.setup(prompt_tokens, prompt_mel, spk)
    fresh = [{"token": t, "spk": spk} for t in tokens]
    return run_stream(step.stock_call, step, state, fresh)
