"""The contracts of the Token2Wav steps: clocks, state regions and wrapped callables."""

from __future__ import annotations

from cadence_fx.adapters.token2wav.config import (CFM_PATH, ENCODER_PATH, ESTIMATOR_PATH, VOCODER_PATH, Driver,
                                                  Granularity, Token2WavConfig)
from cadence_fx.contract import Clock, Contract, Region, Ring, SlidingWindow

__all__ = ["dit_step_contract", "encoder_step_contract", "token2wav_contract"]


def _clocks(cfg: Token2WavConfig) -> tuple[Clock, ...]:
    return (Clock("token", cfg.chunk_tokens, "speech tokens per call"),
            Clock("frame", cfg.chunk_frames, "mel frames per call"),
            Clock("step", cfg.n_timesteps, "solver steps per call"),
            Clock("sample", cfg.chunk_frames * cfg.hop_samples, "PCM samples per call"))


def token2wav_contract(cfg: Token2WavConfig, granularity: Granularity = "chunk", *, driver: Driver = "0.1.2",
                       vocoder: bool = True, step_segments: bool = True) -> Contract:
    """The native-clock contract of :class:`~cadence_fx.adapters.token2wav.Token2WavStep`.

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
      overwrite rather than concatenate: ``Ring(3840)`` with ``order=None``, empty before the first
      chunk.

    Wrapped callables: the encoder, the CFM loop (``"chunk"``: one partition per chunk) or the
    estimator (``"step"``: one partition per solver step), and the vocoder. At the chunk clock,
    ``step_segments`` (default) captures the CFM loop as one graph per solver step
    (``Contract.split_at`` the estimator) while keying and replaying it once per chunk: ten small
    step graphs replay faster than the single graph of the whole loop with the same kernels
    (measurements in ``docs/benchmarks.md``). Export then needs the estimator visible, which
    :meth:`Token2WavStep.export_context` arranges.
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
            # written in place (HiFT's ``s[:, :, :n] = cache_source``, the fade's slice assignment)
            Region("vocoder_source", input="source_cache", output=7, clock="sample", axis=2, order=None,
                   retention=Ring(n), initial=0),
            Region("vocoder_speech", input="speech_cache", output=8, clock="sample", axis=1, order=None,
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
