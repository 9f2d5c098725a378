"""The stock upstream modules, built at a :class:`Token2WavConfig` with seeded random weights.

The released weights are not needed (nor available here): every builder seeds its own draws, so
two builds of one configuration are the same model.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import nn

from cadence_fx.adapters.token2wav.config import Token2WavConfig
from cadence_fx.adapters.token2wav.driver import new_bounded_stream

__all__ = ["build_causal_vocoder", "build_dit", "build_encoder", "build_flow", "build_vocoder"]


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
    """Re-register the workspace buffer ``name`` with ``frames`` positions on ``axis`` (zeros, same dtype
    and device); ``None`` keeps the stock capacity."""
    if frames is None:
        return
    old = getattr(module, name)
    shape = list(old.shape)
    shape[axis] = frames
    module.register_buffer(name, torch.zeros(shape, dtype=old.dtype, device=old.device), persistent=False)
